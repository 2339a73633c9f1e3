"""How much memory does one policy-loss step take with the LM head in chunks, against the full [B, T, V] log-softmax?

One forward + backward of a GRPO/PPO clipped policy loss (trainer.losses.ppo_policy_loss, token mean, with the
entropy as a metric) through a Qwen2 decoder of small hidden size (64, 2 layers) and a real vocabulary (151,936,
Qwen2.5's), over 4,096 tokens (4 rows of 1,024). At that shape the head dominates everything else, as it does for
long agentic contexts at real sizes.

  full      the baseline, what the trainer did before trainer/lm_head.py: the head over all positions, log_softmax
            of the whole [B, T, V] in float32, gather, and the entropy from a second log_softmax (no gradient).
  chunked   the trainer now (trainer.model.run_policy): the head, log-softmax, gather and entropy chunk_tokens rows
            at a time, and in the backward each chunk's logits recomputed (model.logprob_chunk_tokens, 1,024 by
            default; the table also shows 256 and 4,096).

Peak memory is the growth of the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) over
its resident set once the model and inputs exist; each variant runs in a fresh process, twice (the larger peak
and the shorter time kept). On CUDA (when present) it is torch.cuda.max_memory_allocated over memory_allocated instead. Seconds are the
step's wall time (one thread). `--quick` runs 1,024 tokens (1 row) in chunks of 256, the same ratio of tokens to
chunk as the headline's 4,096 in chunks of 1,024 (< 1 minute).

    python bench/trainer_memory.py [--quick] [--tokens 4096] [--device cpu|cuda]
"""

import argparse
import json
import pathlib
import re
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VOCAB = 151_936
HIDDEN = 64
ROW_TOKENS = 1024


def build_policy(chunk_tokens: int, device: str):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.model import PolicyModel

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * ROW_TOKENS,
                         tie_word_embeddings=False)
    return PolicyModel(Qwen2ForCausalLM(config), chunk_tokens=chunk_tokens).to(device).eval()


def full_outputs(policy, input_ids, attention_mask):
    """The baseline: the trainer's forward before the chunked head (logits [B, T, V], log_softmax, gather, entropy)."""
    import torch

    from trainer.losses import entropy_from_logits

    hidden = policy.lm.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    logits = policy.lm.get_output_embeddings()(hidden)
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    logprobs = log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = entropy_from_logits(logits[:, :-1])
    return logprobs, entropy


def step(policy, variant: str, input_ids, attention_mask, old, advantages, mask) -> float:
    """One policy-loss forward + backward; its entropy metric, so nothing is optimised away."""
    from trainer.losses import ppo_policy_loss
    from trainer.model import run_policy

    if variant == "full":
        logprobs, entropy = full_outputs(policy, input_ids, attention_mask)
    else:
        out = run_policy(policy, input_ids, attention_mask)
        logprobs, entropy = out.logprobs, out.entropy
    losses, _, _ = ppo_policy_loss(logprobs, old, advantages, 0.2, 0.28)
    ((losses * mask).sum() / mask.sum()).backward()
    policy.zero_grad(set_to_none=True)
    return float((entropy * mask).sum() / mask.sum())


def _status_kb(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", pathlib.Path("/proc/self/status").read_text())[1])


def child(variant: str, chunk: int, tokens: int, device: str, repeats: int) -> dict:
    """Measure one variant in this (fresh) process: peak bytes above the settled state, seconds, per repeat."""
    import torch

    from services.device import peak_memory_bytes, reset_peak_memory

    torch.set_num_threads(1)
    dev = torch.device(device)
    policy = build_policy(chunk, device)
    rows = max(1, tokens // ROW_TOKENS)
    width = tokens // rows
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, VOCAB, (rows, width), generator=g).to(dev)
    attention_mask = torch.ones_like(input_ids)
    old = (-12.0 + torch.randn(rows, width - 1, generator=g)).to(dev)
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width - 1).to(dev)
    mask = torch.ones(rows, width - 1, device=dev)
    peaks, seconds = [], []
    for _ in range(repeats):
        if dev.type == "cpu":
            base = _status_kb("VmRSS")
            pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        else:
            torch.accelerator.synchronize()
            base = torch.accelerator.memory_allocated(dev) if hasattr(torch.accelerator, "memory_allocated") else 0
            reset_peak_memory(dev)
        started = time.perf_counter()
        step(policy, variant, input_ids, attention_mask, old, advantages, mask)
        if dev.type == "cpu":
            peaks.append((_status_kb("VmHWM") - base) * 1024)
        else:
            torch.accelerator.synchronize()
            peaks.append(peak_memory_bytes(dev) - base)
        seconds.append(time.perf_counter() - started)
    return {"peak": max(peaks), "seconds": min(seconds)}


def run_variant(variant: str, chunk: int, tokens: int, device: str, repeats: int) -> dict:
    command = [sys.executable, __file__, "--child", variant, "--chunk", str(chunk), "--tokens", str(tokens),
               "--device", device, "--repeats", str(repeats)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1,024 tokens in chunks of 256 only (< 1 minute)")
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the batch (default 4,096; quick 1,024)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=1024, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=None, help="steps per variant (default 2; quick 1)")
    args = parser.parse_args()
    tokens = args.tokens or (1024 if args.quick else 4096)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    repeats = args.repeats or (1 if args.quick else 2)
    if args.child:
        print(json.dumps(child(args.child, args.chunk, tokens, args.device, repeats)))
        return
    headline = 256 if args.quick else 1024  # tokens / chunk = 4 either way
    chunks = [headline] if args.quick else [256, 1024, 4096]
    print(f"one policy-loss forward + backward, {tokens} tokens, vocabulary {VOCAB}, hidden {HIDDEN}, "
          f"on {args.device} (peak {'RSS growth' if args.device == 'cpu' else 'allocated'})")
    results = {"full": run_variant("full", 0, tokens, args.device, repeats)}
    for chunk in chunks:
        results[f"chunked {chunk}"] = run_variant("chunked", chunk, tokens, args.device, repeats)
    full = results["full"]
    print(f"{'variant':<16}{'peak MiB':>10}{'vs full':>9}{'seconds':>9}")
    for name, r in results.items():
        print(f"{name:<16}{r['peak'] / 2**20:>10.0f}{r['peak'] / full['peak']:>9.3f}{r['seconds']:>9.2f}")
    ratio = results[f"chunked {headline}"]["peak"] / full["peak"]
    print(f"result: chunked_vs_full_peak = {ratio:.3f} (baseline full [B,T,V] log_softmax, {tokens} tokens in chunks "
          f"of {headline}, target <= 0.25)")


if __name__ == "__main__":
    main()
