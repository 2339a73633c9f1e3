"""Completions/s of the quickstart's rollout workload through the real rollout service, vs transformers `generate`.

Workload (the quickstart's): tiny Qwen2 (hidden 128, 2 layers, 4 heads / 2 kv heads, head_dim 32,
char vocabulary), float32, CPU; 2-digit addition prompts ("12+34=" plus bos, 7 tokens);
n=8 completions per request, up to 4 new tokens, temperature 1, logprobs on.

- service: the rollout service as its own process (`deploy.local.service_process.start_service`, 1 torch
  thread), driven over gRPC by `--concurrency` unary `Generate` calls in flight, as the driver does.
  Cost = the server process's CPU time (read from the OS) per completion, and wall time.
- engine: the same requests through `LLMEngine.generate` in this process (no gRPC), 8 at a time.
- baseline: transformers `generate` on the same batches of 64 completions (8 prompts x 8 samples,
  one call per 8 prompts), same sampling and max tokens, in this process.

Runs alternate and repeat; the table shows medians of CPU time (the 2 cores here are shared, so
wall time mostly measures the neighbours) and wall time. Load average is printed with the numbers.

    python bench/rollout_small.py [--quick]
"""

import argparse
import asyncio
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil
import torch

from protos import rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_array, encode_array
from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import char_tokenizer, write_tiny_model
from services.client import connect

N, MAX_TOKENS, PROMPTS_PER_BATCH = 8, 4, 8


def make_prompts(count: int, seed: int) -> list[list[int]]:
    tokenizer, rng = char_tokenizer(), random.Random(seed)
    return [[tokenizer.bos_token_id, *tokenizer(f"{rng.randint(10, 99)}+{rng.randint(10, 99)}=").input_ids]
            for _ in range(count)]


async def run_service(address: str, prompts: list[list[int]], concurrency: int, seed: int) -> tuple[int, list[float]]:
    """All prompts through Generate with `concurrency` calls in flight; (completions, per-call latencies)."""
    channel = connect(address)
    stub = rollout_pb2_grpc.RolloutStub(channel)
    pending = iter(enumerate(prompts))
    latencies: list[float] = []
    completions = 0

    async def worker() -> None:
        nonlocal completions
        for i, prompt in pending:
            request = rollout_pb2.GenerateRequest(
                request_id=f"r{seed}-{i}", prompt_ids=encode_array(prompt, "int32"),
                params=rollout_pb2.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=N, logprobs=True,
                                                  seed=seed * 100_003 + i))
            start = time.perf_counter()
            reply = await stub.Generate(request, timeout=120)
            latencies.append(time.perf_counter() - start)
            for completion in reply.completions:
                decode_array(completion.token_ids, "token_ids", "int32")
                completions += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    await channel.close()
    return completions, latencies


def run_engine(engine: LLMEngine, prompts: list[list[int]], seed: int) -> int:
    completions = 0
    for start in range(0, len(prompts), PROMPTS_PER_BATCH):
        chunk = prompts[start : start + PROMPTS_PER_BATCH]
        params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=N, seed=seed * 100_003 + start + i)
                  for i in range(len(chunk))]
        completions += sum(len(out.completions) for out in engine.generate(chunk, params))
    return completions


def run_transformers(model, prompts: list[list[int]], seed: int) -> int:
    """Batches of PROMPTS_PER_BATCH prompts x N samples (64 completions) per generate call."""
    torch.manual_seed(seed)
    completions = 0
    for start in range(0, len(prompts), PROMPTS_PER_BATCH):
        chunk = prompts[start : start + PROMPTS_PER_BATCH]
        width = max(len(p) for p in chunk)
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=MAX_TOKENS, num_return_sequences=N, pad_token_id=0, eos_token_id=2)
        completions += out.shape[0]
    return completions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and repeats (under a minute)")
    parser.add_argument("--requests", type=int, default=None, help="Generate calls per run (default 256, quick 96)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of each (default 5, quick 2)")
    parser.add_argument("--concurrency", type=int, default=8, help="Generate calls in flight")
    args = parser.parse_args()
    num_requests = args.requests or (96 if args.quick else 256)
    repeats = args.repeats or (2 if args.quick else 5)
    torch.set_num_threads(1)

    from transformers import AutoModelForCausalLM

    from deploy.local.service_process import start_service

    workdir = tempfile.mkdtemp(prefix="bench-rollout-small-")
    folder = write_tiny_model(f"{workdir}/model", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                              head_dim=32, seed=0)
    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    engine = LLMEngine(EngineConfig(model=str(folder), max_model_len=64, max_num_seqs=64))
    service = start_service("rollout", {"model": str(folder), "engine.max_num_seqs": 64, "engine.torch_threads": 1,
                                        "engine.max_model_len": 64}, log_dir=f"{workdir}/logs")
    server = psutil.Process(service.pid)
    samples: dict[str, list[tuple[float, float]]] = {"service": [], "engine": [], "transformers": []}
    latencies: list[float] = []
    try:
        def timed_service(seed: int) -> tuple[float, float]:
            cpu, wall = server.cpu_times(), time.perf_counter()
            done, lat = asyncio.run(run_service(service.address, make_prompts(num_requests, seed), args.concurrency, seed))
            after = server.cpu_times()
            latencies.extend(lat)
            return done / (after.user + after.system - cpu.user - cpu.system), done / (time.perf_counter() - wall)

        def timed_local(fn, seed: int) -> tuple[float, float]:
            prompts = make_prompts(num_requests, seed)
            cpu, wall = time.process_time(), time.perf_counter()
            with torch.inference_mode():
                done = fn(prompts, seed)
            return done / (time.process_time() - cpu), done / (time.perf_counter() - wall)

        runs = {
            "service": timed_service,
            "engine": lambda s: timed_local(lambda p, q: run_engine(engine, p, q), s),
            "transformers": lambda s: timed_local(lambda p, q: run_transformers(hf_model, p, q), s),
        }
        for fn in runs.values():
            fn(10_000)  # warm-up
        latencies.clear()
        for r in range(repeats):
            for name, fn in runs.items():
                samples[name].append(fn(r))
    finally:
        service.stop(timeout=10)

    medians = {name: (statistics.median(c for c, _ in s), statistics.median(w for _, w in s)) for name, s in samples.items()}
    load = os.getloadavg()
    print(f"tiny qwen2 hidden 128 x 2 layers, head_dim 32, float32, CPU, 1 thread; {num_requests} requests x n={N}, "
          f"max_tokens {MAX_TOKENS}, concurrency {args.concurrency}; median of {repeats}; "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"{'path':>12} | {'completions/s cpu':>17} | {'completions/s wall':>18}")
    for name, (cpu, wall) in medians.items():
        print(f"{name:>12} | {cpu:>17.0f} | {wall:>18.0f}")
    lat = sorted(latencies)
    print(f"service Generate latency: p50 {1000 * lat[len(lat) // 2]:.1f} ms, p90 {1000 * lat[int(len(lat) * 0.9)]:.1f} ms")
    hf_cpu, hf_wall = medians["transformers"]
    print(f"result: service_completions_per_s_wall = {medians['service'][1]:.0f} (baseline transformers generate "
          f"{hf_wall:.0f}/s wall, target none)")
    print(f"result: service_completions_per_cpu_s_ratio = {medians['service'][0] / hf_cpu:.2f} (baseline transformers "
          f"generate, server CPU time, target > 1)")
    print(f"result: engine_completions_per_cpu_s_ratio = {medians['engine'][0] / hf_cpu:.2f} (baseline transformers "
          f"generate, CPU time, target > 1)")


if __name__ == "__main__":
    main()
