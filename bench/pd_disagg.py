"""Prefill/decode disaggregation vs one monolithic worker: time to first token, time per output token, and KV
bytes moved per request with and without compression on the wire.

Setup (all real processes on loopback, 1 torch thread each): a monolithic rollout worker; the split: one prefill
worker, a decode worker (wire codec none) and the rollout router in front of it; a second decode worker asking
for int8 KV. Model: the tiny Qwen2 (hidden 128, 2 layers, 2 kv heads, head_dim 32, float32) with its logits
scaled 4x (a random model's next-token distribution is near uniform, so any rounding flips its greedy ties; a
trained model's is not; tests/conftest.py sharp_model_dir). Prompts: 48-96 tokens, greedy, 32 new tokens.

- TTFT: GenerateStream call to its first chunk; TPOT: (last chunk - first chunk) / (tokens - 1); medians over
  the requests, at each concurrency (calls in flight), monolithic (baseline) and split through the router.
- bytes/request: encoded KV payload of a Prefill with codec none, int8, int4 (bytes on the wire).
- greedy agreement: tokens of the int8 decode worker equal to the monolithic worker's, position by position.

On one 2-core machine the split adds hops and shares the same cores: it shows the cost of the split, not the
gain it gives when prefill and decode run on separate devices.

    python bench/pd_disagg.py [--quick]
"""

import argparse
import asyncio
import os
import pathlib
import random
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from protos import kv_pb2, kv_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_array, encode_array
from services.client import connect

MAX_TOKENS = 32


def sharp_model(folder: pathlib.Path) -> pathlib.Path:
    from safetensors.torch import load_file, save_file

    from rollout.model.tiny import write_tiny_model

    model = write_tiny_model(folder / "qwen2", seed=0)
    weights = load_file(model / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def requests(count: int, seed: int) -> list[rollout_pb2.GenerateRequest]:
    rng = random.Random(seed)
    return [rollout_pb2.GenerateRequest(
        request_id=f"b{seed}-{i}", prompt_ids=encode_array([rng.randrange(3, 100) for _ in range(rng.randint(48, 96))],
                                                           "int32"),
        params=rollout_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)) for i in range(count)]


async def stream_timings(address: str, batch, concurrency: int) -> tuple[list[float], list[float], list[list[int]]]:
    """(TTFTs, TPOTs, tokens) of every request, `concurrency` streams in flight."""
    ttfts, tpots, tokens = [], [], [None] * len(batch)
    pending = iter(enumerate(batch))
    async with connect(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)

        async def worker():
            for i, request in pending:
                start = time.perf_counter()
                first = last = None
                got: list[int] = []
                async for chunk in stub.GenerateStream(request, timeout=300):
                    last = time.perf_counter()
                    first = first or last
                    got += decode_array(chunk.token_ids).tolist()
                ttfts.append(first - start)
                tpots.append((last - first) / max(1, len(got) - 1))
                tokens[i] = got

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ttfts, tpots, tokens


async def payload_bytes(address: str, batch, codec: str) -> int:
    async with connect(address) as channel:
        stub = kv_pb2_grpc.PrefillWorkerStub(channel)
        total = 0
        for request in batch:
            async for chunk in stub.Prefill(kv_pb2.PrefillRequest(request=request, codec=codec), timeout=60):
                total += len(chunk.payload)
        return total


async def generate_tokens(address: str, batch) -> list[list[int]]:
    async with connect(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        replies = await asyncio.gather(*(stub.Generate(r, timeout=300) for r in batch))
    return [decode_array(r.completions[0].token_ids).tolist() for r in replies]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and concurrencies (under a minute)")
    args = parser.parse_args()
    from deploy.local.service_process import start_service

    concurrencies = [1, 4] if args.quick else [1, 4, 16]
    count = 8 if args.quick else 32
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="pd-bench-"))
    model = {"model": str(sharp_model(workdir)), "engine.max_model_len": 256, "engine.torch_threads": 1}
    logs = workdir / "logs"
    started = []
    try:
        mono = start_service("rollout", model, log_dir=logs)
        prefill = start_service("prefill", model, log_dir=logs)
        decode = start_service("decode", {**model, "prefill": [prefill.address]}, log_dir=logs)
        decode_int8 = start_service("decode", {**model, "prefill": [prefill.address], "codec": "int8"}, log_dir=logs)
        router = start_service("rollout", {**model, "router.decode": [decode.address]}, log_dir=logs)
        started = [mono, prefill, decode, decode_int8, router]
        print(f"{'concurrency':>11} {'setup':>10} {'TTFT ms':>9} {'TPOT ms':>9}")
        ratios = {}
        reference = None
        same_tokens: list[bool] = []  # per concurrency: the split's greedy tokens are the monolithic worker's
        for concurrency in concurrencies:
            batch = requests(count, seed=concurrency)
            medians = {}
            for name, address in (("monolithic", mono.address), ("split", router.address)):
                ttfts, tpots, tokens = asyncio.run(stream_timings(address, batch, concurrency))
                medians[name] = (statistics.median(ttfts) * 1e3, statistics.median(tpots) * 1e3)
                print(f"{concurrency:>11} {name:>10} {medians[name][0]:>9.2f} {medians[name][1]:>9.2f}")
                if name == "monolithic":
                    reference = tokens
                else:
                    same_tokens.append(tokens == reference)
            ratios[concurrency] = tuple(s / m for s, m in zip(medians["split"], medians["monolithic"]))
        batch = requests(count, seed=0)
        sizes = {codec: asyncio.run(payload_bytes(prefill.address, batch, codec)) / count
                 for codec in ("none", "int8", "int4")}
        print("\nKV bytes per request (prompts 48-96 tokens): " +
              ", ".join(f"{codec} {size:,.0f}" for codec, size in sizes.items()))
        expected = asyncio.run(generate_tokens(mono.address, batch))
        got = asyncio.run(generate_tokens(decode_int8.address, batch))
        agree = sum(a == b for e, g in zip(expected, got) for a, b in zip(e, g)) / sum(len(e) for e in expected)
        print()
        for concurrency, (ttft, tpot) in ratios.items():
            print(f"result: ttft_split_over_monolithic_c{concurrency} = {ttft:.2f} (baseline monolithic worker, "
                  "target none: one machine shows the split's cost)")
            print(f"result: tpot_split_over_monolithic_c{concurrency} = {tpot:.2f} (baseline monolithic worker, "
                  "target none)")
        print(f"result: kv_bytes_reduction_int8 = {sizes['none'] / sizes['int8']:.2f} (baseline codec none, "
              "target >= 3.5)")
        print(f"result: kv_bytes_reduction_int4 = {sizes['none'] / sizes['int4']:.2f} (baseline codec none, "
              "target none)")
        print(f"result: split_tokens_identical = {all(same_tokens)} (baseline monolithic worker, target True)")
        print(f"result: greedy_agreement_int8 = {agree:.4f} (baseline monolithic worker, target >= 0.99)")
    finally:
        for service in started:
            service.stop(timeout=10)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
