"""How much memory does a rank hold with the policy in 2 pipeline stages (parallel.pp 2), against one process
holding it whole, and how much of a step is the pipeline's bubble?

The trainer's own step (trainer.learner.Learner: GRPO, off_policy none, AdamW) on a float32 Qwen2 decoder of hidden
1,024, 12 layers, 16 heads, MLP 2,048 wide and the tiny kit's 101-token vocabulary (126 M parameters: the layers
dominate, as they do at real sizes), a batch of 8 samples of 64 tokens, micro-batches of 1 row (8 a step, 4 x pp).
Run on the CPU over gloo, one thread per process:

  pp1   a plain process (a world of one): the whole model, its gradients and Adam's two moments.
  pp2   `torchrun --nproc_per_node 2` with parallel.pp 2 and the 1F1B schedule: each rank 6 layers (the first also
        the embedding, the second the norm and LM head); then, in a second launch, the interleaved 1F1B schedule
        (2 stages of 3 layers per rank).

Peak memory is the growth of each process's peak resident set (VmHWM, reset through /proc/self/clear_refs) over
its resident set before the learner is built, after `--steps` steps, each run in processes of its own; the pp2
figure is its larger rank's, and nothing is subtracted. The target (<= 0.6) is about the model's state, which the
stages split: parameters, gradients and Adam's two moments, 16 bytes a parameter (2.0 GB here, 1.0 GB a stage).
What else a process holds at its peak (the step's activations and temporaries, the allocator's slack: ~100 MB)
does not halve, so the shape is one where the model state dominates, as it does where stages are wanted (at hidden
512, 8 layers, 21 M parameters, 128 tokens a sample, this bench measured 0.611). The bubble is the trainer's
metric (trainer/parallel/pipeline.py: per stage, the fraction of the schedule's wall time it computed nothing, from
its own timestamps), averaged over the stages and over the steps after the first. The step time is a record, not
a target: the machine's cores may be shared (about 6 minutes in all on 2 shared cores).

    python bench/trainer_pipeline.py [--steps 3]
"""

import argparse
import json
import os
import pathlib
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = {"hidden_size": 1024, "num_layers": 12, "num_heads": 16, "num_kv_heads": 16, "head_dim": 64,
         "intermediate_size": 2048}
SAMPLES, PROMPT, RESPONSE, MICRO = 8, 16, 48, 1


def _status(field: str) -> int:
    text = pathlib.Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024


def _samples():
    import numpy as np

    from protos.sample import Sample

    rng = np.random.default_rng(0)
    return [Sample(sample_id=f"s{i}", prompt_id=f"p{i // 4}", group_size=4,
                   prompt_ids=rng.integers(3, 90, PROMPT).astype(np.int32),
                   response_ids=rng.integers(3, 90, RESPONSE).astype(np.int32),
                   loss_mask=np.ones(RESPONSE, dtype=np.uint8),
                   rollout_logprobs=np.full(RESPONSE, -4.6, dtype=np.float32),
                   weight_versions=np.zeros(RESPONSE, dtype=np.int64), reward=float(i % 3))
            for i in range(SAMPLES)]


def run(model: str, steps: int, schedule: str, env) -> dict:
    from trainer.config import TrainerConfig
    from trainer.learner import Learner

    config = TrainerConfig.model_validate({
        "model_path": model, "optim": {"lr": 1e-5},
        "algorithm": {"name": "grpo", "off_policy": "none"},
        "batch": {"global_batch_size": SAMPLES, "micro_batch_size": MICRO},
        "parallel": {"pp": env.pp_size, "pp_schedule": schedule},
    })  # fmt: skip
    pathlib.Path("/proc/self/clear_refs").write_text("5")
    base = _status("VmRSS")
    learner = Learner(config, env)
    seconds, bubbles = [], []
    for step in range(steps):
        start = time.perf_counter()
        for mini_batch in learner.prepare(_samples()):
            metrics = learner.train_step(mini_batch, step)
        seconds.append(time.perf_counter() - start)
        bubbles.append(metrics.get("pp_bubble", 0.0))
    parameters = sum(p.numel() for p in learner.policy.parameters())
    return {"peak_mb": (_status("VmHWM") - base) / 2**20, "parameters": parameters,
            "step_s": statistics.median(seconds[1:]), "bubble": statistics.mean(bubbles[1:])}


def worker(args) -> None:
    import torch

    torch.set_num_threads(1)
    from trainer.parallel import init_distributed, shutdown_distributed

    env = init_distributed("cpu", pp=args.pp)
    result = run(args.model, args.steps, args.schedule, env)
    pathlib.Path(args.out, f"rank{env.rank}.json").write_text(json.dumps(result))
    shutdown_distributed(env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from rollout.model.tiny import write_tiny_model

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_model(pathlib.Path(tmp) / "model", **SHAPE, seed=0)
        script = [str(pathlib.Path(__file__)), "--worker", "--model", str(model), "--steps", str(args.steps)]
        runs = {}
        # Each run in processes of its own: a process's resident set does not shrink when a learner is freed.
        for pp, schedule in ((1, "1f1b"), (2, "1f1b"), (2, "interleaved_1f1b")):
            out = pathlib.Path(tmp, f"pp{pp}-{schedule}")
            out.mkdir()
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            launch = [sys.executable] if pp == 1 else [
                sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(port)]
            subprocess.run([*launch, *script, "--pp", str(pp), "--schedule", schedule, "--out", str(out)],
                           check=True, env=env, cwd=ROOT)
            runs[pp, schedule] = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    one = runs[1, "1f1b"][0]
    staged = {schedule: ranks for (pp, schedule), ranks in runs.items() if pp == 2}
    peak2 = max(rank["peak_mb"] for rank in staged["1f1b"])
    per_rank = ", ".join(f"{r['parameters'] / 1e6:.0f} M" for r in staged["1f1b"])
    print(f"shape: Qwen2 hidden {SHAPE['hidden_size']}, {SHAPE['num_layers']} layers, {SHAPE['num_heads']} heads, "
          f"MLP {SHAPE['intermediate_size']}, {one['parameters'] / 1e6:.0f} M parameters (pp2 1F1B: {per_rank} a "
          f"rank); {SAMPLES} samples x {PROMPT + RESPONSE} tokens, micro-batches of {MICRO} row ({SAMPLES // MICRO} a "
          "step); GRPO + AdamW, float32, CPU/gloo, 1 thread per process")
    print(f"pp1: peak +{one['peak_mb']:.0f} MB, step {one['step_s']:.2f} s")
    for schedule, ranks in staged.items():
        print(f"pp2 {schedule}: peak per rank " + ", ".join(f"+{r['peak_mb']:.0f} MB" for r in ranks)
              + f", step {max(r['step_s'] for r in ranks):.2f} s, bubble {ranks[0]['bubble']:.3f}")
    print(f"result: pp2_peak_memory_per_rank_vs_pp1 = {peak2 / one['peak_mb']:.3f} (baseline: one process holding "
          f"the whole model, +{one['peak_mb']:.0f} MB; pp2 1F1B's larger rank +{peak2:.0f} MB)")
    for schedule, ranks in staged.items():
        print(f"result: pp2_{schedule}_bubble_fraction = {ranks[0]['bubble']:.3f} (mean over the 2 stages and "
              f"steps 2..{args.steps}, {SAMPLES // MICRO} micro-batches a step)")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        parser = argparse.ArgumentParser()
        parser.add_argument("--worker", action="store_true")
        parser.add_argument("--model", required=True)
        parser.add_argument("--steps", type=int, required=True)
        parser.add_argument("--pp", type=int, required=True)
        parser.add_argument("--schedule", required=True)
        parser.add_argument("--out", required=True)
        worker(parser.parse_args())
    else:
        main()
