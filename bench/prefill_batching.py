"""The prefill worker's batching: concurrent prefills for KV transfer as one batch vs one at a time.

A prefill worker's concurrent Prefill calls that wait together run as one prefill batch (up to
max_num_batched_tokens of prompt; rollout/engine/async_engine.py, kv_handoff.prefill_many_for_transfer). Baseline: the
same requests prefilled one at a time (prefill_for_transfer, as the worker ran them before), in the same run on
the same engine settings. Both export every prompt's KV, as a transfer needs. Model: the tiny Qwen2 (hidden 128,
2 layers) and a wider one (hidden 512, 4 layers), float32, one torch thread (the rollout service's default here).
Prompts: 48-96 tokens, n = 1 and n = 8 (a GRPO group prefilled once), 64 requests; best of 3 repeats.

    python bench/prefill_batching.py [--requests 64] [--repeats 3]
"""

import argparse
import os
import pathlib
import random
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def one_at_a_time(engine, requests) -> None:
    from rollout.engine.kv_handoff import prefill_for_transfer

    for request_id, prompt, params in requests:
        prefill_for_transfer(engine, request_id, prompt, params)


def batched(engine, requests) -> None:
    """As the prefill worker batches them: up to max_num_batched_tokens of prompt per batch."""
    from rollout.engine.kv_handoff import budget_batches, prefill_many_for_transfer

    for batch in budget_batches(requests, engine.config.max_num_batched_tokens):
        prefill_many_for_transfer(engine, batch)


def main() -> None:
    import torch

    from rollout.config import EngineConfig
    from rollout.engine.llm_engine import LLMEngine
    from rollout.engine.sampling_params import SamplingParams
    from rollout.model.tiny import write_tiny_model

    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 90) for _ in range(rng.randint(48, 96))] for _ in range(args.requests)]
    with tempfile.TemporaryDirectory() as tmp:
        for label, size in [("tiny", {}), ("wide", {"hidden_size": 512, "num_layers": 4, "num_heads": 8,
                                                     "num_kv_heads": 4, "head_dim": 64})]:
            model = write_tiny_model(pathlib.Path(tmp) / label, seed=0, **size)
            for n in (1, 8):
                params = SamplingParams(temperature=1.0, max_tokens=16, n=n, seed=1)
                engine = LLMEngine(EngineConfig(model=str(model), max_model_len=256, enable_prefix_caching=False))
                budget = engine.config.max_num_batched_tokens
                requests = [(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]

                alone_s = min(timed(one_at_a_time, engine, requests) for _ in range(args.repeats))
                batched_s = min(timed(batched, engine, requests) for _ in range(args.repeats))
                print(f"{label} n={n}: one at a time {args.requests / alone_s:.1f} prompts/s, batched "
                      f"{args.requests / batched_s:.1f} prompts/s (budget {budget} tokens)")
                print(f"result: prefill_batching_speedup_{label}_n{n} = {alone_s / batched_s:.2f} (baseline one "
                      f"prefill at a time, same engine, same run, target > 1)")


if __name__ == "__main__":
    main()
