"""One GRPO optimizer step through the project's trainer (trainer.learner.Learner: prepare + train_step) at Qwen2.5-0.5B's
shape on a GPU, against a plain hand-written torch step of the same clipped policy-gradient loss on the same model, in
the same run: seconds per step and peak GPU memory of each.

Model: random weights of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 kv heads of 64, MLP 4864, vocab
151,936, untied head: about 630M parameters); `--shape small` is a stand-in of the same code paths for a CPU dry run.
Both steps: float32 parameters, bf16 autocast on CUDA (the trainer's `dtype: bfloat16`), AdamW, grad-norm clipping at
1.0, `--micro` rows per micro-batch, half of each row prompt and half response, groups of 8 rows, random rewards.
One warm-up step each, then `--steps` timed steps (device sync around each), median.

    python bench/trainer_gpu_step.py [--quick] [--device cuda|cpu] [--batch 64 --seq 256 --micro 16]

First measured on one H200 (2026-12-04, 64 x 256 tokens, micro-batches of 16): the Learner 0.530 s and 29.2 GiB, a
plain torch step 0.432 s (MEASURED.md).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_shape import SHAPES, build_model

GROUP = 8


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_samples(rows: int, seq: int, vocab: int, seed: int):
    from protos.sample import Sample

    rng = np.random.default_rng(seed)
    prompt_len = seq // 2
    response_len = seq - prompt_len
    return [Sample(sample_id=f"s{seed}-{i}", prompt_id=f"p{seed}-{i // GROUP}", group_size=GROUP,
                   prompt_ids=np.r_[1, rng.integers(3, vocab, prompt_len - 1)].astype(np.int32),
                   response_ids=rng.integers(3, vocab, response_len).astype(np.int32),
                   loss_mask=np.ones(response_len, dtype=np.uint8),
                   rollout_logprobs=np.full(response_len, -12.0, dtype=np.float32),
                   weight_versions=np.zeros(response_len, dtype=np.int64), reward=float(rng.integers(0, 2)))
            for i in range(rows)]


def project_step(folder: Path, device: str, args, vocab: int) -> dict:
    from trainer.config import TrainerConfig
    from trainer.learner import Learner
    from trainer.parallel import DistEnv

    config = TrainerConfig.model_validate({
        "model_path": str(folder), "algorithm": {"name": "grpo"}, "optim": {"lr": 1e-6, "max_grad_norm": 1.0},
        "batch": {"global_batch_size": args.batch, "micro_batch_size": args.micro},
        "dtype": args.dtype, "device": "cuda" if device.startswith("cuda") else "cpu",
    })
    on = torch.device("cuda", torch.cuda.current_device()) if device.startswith("cuda") else torch.device("cpu")
    learner = Learner(config, DistEnv(rank=0, world_size=1, device=on))
    steps, prepares, metrics = [], [], {}
    for i in range(1 + args.steps):
        samples = make_samples(args.batch, args.seq, vocab, seed=i)
        sync(device)
        started = time.perf_counter()
        (mini,) = learner.prepare(samples)
        sync(device)
        prepared = time.perf_counter()
        metrics = learner.train_step(mini, i)
        sync(device)
        if i:  # the first is the warm-up
            prepares.append(prepared - started)
            steps.append(time.perf_counter() - prepared)
    result = {"step_s": statistics.median(steps), "prepare_s": statistics.median(prepares), "metrics": metrics}
    if device.startswith("cuda"):
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def plain_step(folder: Path, device: str, args) -> dict:
    """The same objective by hand: token-mean clipped surrogate with group-normalised advantages."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.startswith("cuda"))
    autocast = args.dtype == "bfloat16" and device.startswith("cuda")
    vocab = model.config.vocab_size
    times = []
    for i in range(1 + args.steps):
        samples = make_samples(args.batch, args.seq, vocab, seed=100 + i)
        sync(device)
        started = time.perf_counter()
        ids = torch.tensor(np.stack([np.r_[s.prompt_ids, s.response_ids] for s in samples]), dtype=torch.int64)
        rewards = torch.tensor([s.reward for s in samples]).view(-1, GROUP)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        mask = torch.zeros(ids.shape[0], ids.shape[1] - 1)
        mask[:, samples[0].prompt_ids.size - 1:] = 1.0
        total = mask.sum()
        for m in range(0, args.batch, args.micro):
            x = ids[m: m + args.micro].to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                logits = model(x, attention_mask=torch.ones_like(x)).logits
            logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, x[:, 1:, None]).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())
            a = adv[m: m + args.micro].to(device)[:, None]
            loss = -torch.minimum(ratio * a, ratio.clamp(0.8, 1.28) * a)
            ((loss * mask[m: m + args.micro].to(device)).sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i:
            times.append(time.perf_counter() - started)
    result = {"step_s": statistics.median(times)}
    if device.startswith("cuda"):
        result["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: qwen05b on CUDA, small on CPU")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="the trainer's compute dtype (bfloat16 = autocast); default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batch", type=int, default=None, help="rows per step; default 64 (quick: 16)")
    parser.add_argument("--seq", type=int, default=None, help="tokens per row; default 256 (quick: 64)")
    parser.add_argument("--micro", type=int, default=None, help="rows per micro-batch; default 16 (quick: 8)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps after a warm-up; default 3 (quick: 1)")
    parser.add_argument("--quick", action="store_true", help="a small batch and one timed step: a smoke test")
    parser.add_argument("--model-dir", default=None, help="where the model folder is written (default: a temp dir)")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("qwen05b" if cuda else "small")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    quick = {"batch": 16, "seq": 64, "micro": 8, "steps": 1} if args.quick else {"batch": 64, "seq": 256, "micro": 16,
                                                                                 "steps": 3}
    for key, value in quick.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if cuda:
        print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    else:
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="trainer-gpu-step-") as scratch:
        folder = build_model(Path(args.model_dir or scratch) / args.shape, args.shape, "bfloat16", args.device)
        tokens = args.batch * args.seq
        print(f"GRPO step: {args.batch} rows x {args.seq} tokens, micro-batches of {args.micro}, {args.dtype} on "
              f"{args.device}; median of {args.steps} after a warm-up", flush=True)
        project = project_step(folder, args.device, args, SHAPES[args.shape]["vocab_size"])
        print(f"project Learner: train_step {project['step_s'] * 1e3:.0f} ms, prepare {project['prepare_s'] * 1e3:.0f} "
              f"ms, loss {project['metrics'].get('loss', float('nan')):.4f}", flush=True)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        plain = plain_step(folder, args.device, args)
    print(f"plain torch: step {plain['step_s'] * 1e3:.0f} ms", flush=True)
    print(f"result: trainer_step_vs_plain_torch = {plain['step_s'] / project['step_s']:.2f} (baseline a plain torch "
          f"step of the same loss and model: {plain['step_s']:.3f} s, the Learner {project['step_s']:.3f} s + prepare "
          f"{project['prepare_s']:.3f} s; {tokens / project['step_s']:.0f} tokens/s; {args.shape} {args.dtype})",
          flush=True)
    if cuda:
        print(f"result: trainer_step_peak_gib = {project['peak_gib']:.1f} (baseline plain torch step "
              f"{plain['peak_gib']:.1f} GiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
