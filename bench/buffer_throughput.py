"""Replay buffer throughput: Put -> Pull -> Ack through a real buffer process, against a raw gRPC relay.

Both servers are separate processes built by the same `create_server` (same interceptors, limits),
fed by the same clients in this process: 4 producers, each with up to 4 Puts of 8 pre-serialized
samples in flight (a durable Put answers only after its fsync, so one Put at a time would measure
disk latency, not throughput), and one consumer that Pulls batches of 8 (up to 16 leased ahead)
and Acks each without waiting for the previous Ack to return. The baseline relay moves the same
bytes through an in-memory queue: no parsing, no validation, no log, no fsync. The buffer runs
with durability on (fsync=batch: group commit). Samples have 1k and 8k tokens (prompt 64 +
response), ~17 bytes per token on the wire. A warm-up of ~100 MB precedes the timed runs.

    python bench/buffer_throughput.py [--quick] [--repeats N]
"""

import argparse
import asyncio
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc
import numpy as np

from protos import buffer_pb2, common_pb2
from protos.sample import Sample

RELAY = "bench.Relay"
BUFFER = "relayrl.buffer.v1.Buffer"
PRODUCERS = 4
SAMPLES_PER_PUT = 8
PROMPT_TOKENS = 64
WARMUP_BYTES = 100e6  # > 3 log segments of the default 32 MiB
OPTIONS = [("grpc.max_send_message_length", 256 << 20), ("grpc.max_receive_message_length", 256 << 20)]


# --- the baseline: a raw relay server (run as a subprocess of this script) ------------------------


def serve_relay(port_file: str) -> None:
    from services.runtime import write_port_file
    from services.server import create_server

    async def main() -> None:
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=64)

        async def put(request: bytes, context) -> bytes:
            await queue.put(request)
            return b""

        async def pull(request: bytes, context):
            while True:
                yield await queue.get()

        async def ack(request: bytes, context) -> bytes:
            return b""

        def add(_servicer, server) -> None:
            handlers = {
                "Put": grpc.unary_unary_rpc_method_handler(put),
                "Pull": grpc.unary_stream_rpc_method_handler(pull),
                "Ack": grpc.unary_unary_rpc_method_handler(ack),
            }
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(RELAY, handlers),))

        server, port = await create_server("127.0.0.1:0", [(add, None, RELAY)])
        await server.start()
        write_port_file(port_file, port=port)
        await server.wait_for_termination()

    asyncio.run(main())


def start_relay(workdir: pathlib.Path) -> tuple[subprocess.Popen, str]:
    port_file = workdir / "relay.port"
    proc = subprocess.Popen([sys.executable, __file__, "--relay", str(port_file)], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the relay server did not start")
        time.sleep(0.05)
    import json

    return proc, f"127.0.0.1:{json.loads(port_file.read_text())['port']}"


# --- the workload ---------------------------------------------------------------------------------


def make_requests(tokens: int, count: int, tag: str) -> list[bytes]:
    """`count` samples as serialized PutRequests of SAMPLES_PER_PUT, ids unique per `tag`."""
    response = tokens - PROMPT_TOKENS
    rng = np.random.default_rng(0)
    template = Sample(
        sample_id="", prompt_id="", group_size=0,
        prompt_ids=rng.integers(0, 32000, PROMPT_TOKENS, dtype=np.int32),
        response_ids=rng.integers(0, 32000, response, dtype=np.int32),
        loss_mask=np.ones(response, dtype=np.uint8),
        rollout_logprobs=rng.normal(-1, 0.5, response).astype(np.float32),
        weight_versions=np.zeros(response, dtype=np.int64), reward=1.0,
    ).to_proto()
    requests = []
    for start in range(0, count, SAMPLES_PER_PUT):
        samples = []
        for i in range(start, min(start + SAMPLES_PER_PUT, count)):
            sample = common_pb2.Sample()
            sample.CopyFrom(template)
            sample.sample_id = sample.prompt_id = f"{tag}-{i}"
            samples.append(sample)
        requests.append(buffer_pb2.PutRequest(samples=samples).SerializeToString())
    return requests


async def run_once(address: str, service: str, requests: list[bytes], samples: int, inflight: int,
                   prefetch: int) -> float:
    """Seconds from the first Put until the consumer has acked every sample."""
    async with grpc.aio.insecure_channel(address, options=OPTIONS) as channel:
        put = channel.unary_unary(f"/{service}/Put")
        pull = channel.unary_stream(f"/{service}/Pull")
        ack = channel.unary_unary(f"/{service}/Ack")
        await channel.channel_ready()
        queue = list(reversed(requests))

        async def produce() -> None:
            while queue:
                await put(queue.pop(), timeout=60)

        producers = [produce() for _ in range(PRODUCERS * inflight)]  # each producer: `inflight` Puts at once

        async def consume() -> None:
            # Like a trainer that prefetches: the next batch streams in while earlier acks are in
            # flight (each Ack still answers only once its record is durable).
            received, acks = 0, []
            call = pull(buffer_pb2.PullRequest(batch_size=SAMPLES_PER_PUT, allow_partial_groups=True,
                                               max_unacked=prefetch, consumer="bench").SerializeToString(),
                        timeout=300)
            async for message in call:
                if service == BUFFER:
                    batch = buffer_pb2.Batch.FromString(message)
                    received += len(batch.samples)
                    request = buffer_pb2.AckRequest(lease_id=batch.lease_id).SerializeToString()
                else:
                    received += len(buffer_pb2.PutRequest.FromString(message).samples)
                    request = b""
                acks.append(asyncio.ensure_future(ack(request, timeout=60)))
                if received >= samples:
                    break
            call.cancel()
            await asyncio.gather(*acks)

        start = time.perf_counter()
        await asyncio.gather(consume(), *producers)
        return time.perf_counter() - start


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_run(pid: int, address: str, service: str, requests: list[bytes], samples: int,
              args: argparse.Namespace) -> tuple[float, float]:
    """(wall seconds, server CPU seconds) of one run."""
    cpu = cpu_seconds(pid)
    wall = asyncio.run(run_once(address, service, requests, samples, args.inflight, args.prefetch))
    return wall, cpu_seconds(pid) - cpu


# --- the benchmark --------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run under a minute")
    parser.add_argument("--repeats", type=int, default=None, help="runs per setting (median quoted)")
    parser.add_argument("--window-ms", type=float, default=2.0, help="the buffer's group-commit window")
    parser.add_argument("--inflight", type=int, default=4, help="Puts each producer keeps in flight")
    parser.add_argument("--prefetch", type=int, default=16, help="batches the Pull stream may lease ahead of acks")
    parser.add_argument("--relay", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.relay:
        serve_relay(args.relay)
        return
    from deploy.local.service_process import start_service

    repeats = args.repeats or (1 if args.quick else 5)
    sizes = {1024: 800 if args.quick else 4000, 8192: 160 if args.quick else 800}
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-buffer-"))
    relay, relay_address = start_relay(workdir)
    buffer = start_service("buffer", {"data_dir": str(workdir / "data"), "fsync": "batch", "capacity": 1 << 20,
                                      "fsync_window_ms": args.window_ms}, log_dir=workdir)
    rows = []
    try:
        for tokens, count in sizes.items():
            sample_bytes = len(make_requests(tokens, SAMPLES_PER_PUT, "size")[0]) / SAMPLES_PER_PUT
            # Warm-up past a few log segment roll-overs: the steady state reuses the page cache of
            # compacted segments (a fresh page costs ~8x more to write on this VM, first touch).
            warm = int(WARMUP_BYTES / sample_bytes) // SAMPLES_PER_PUT * SAMPLES_PER_PUT
            timed_run(relay.pid, relay_address, RELAY, make_requests(tokens, warm, "warm"), warm, args)
            timed_run(buffer.pid, buffer.address, BUFFER, make_requests(tokens, warm, f"warm{tokens}"), warm, args)
            runs: dict[str, list[tuple[float, float]]] = {"raw": [], "buffer": []}
            for rep in range(repeats):  # alternate, so drift on a shared machine hits both alike
                runs["raw"].append(timed_run(relay.pid, relay_address, RELAY, make_requests(tokens, count, "r"),
                                             count, args))
                requests = make_requests(tokens, count, f"t{tokens}-{rep}")
                runs["buffer"].append(timed_run(buffer.pid, buffer.address, BUFFER, requests, count, args))
            rate = {name: count / statistics.median(wall for wall, _ in r) for name, r in runs.items()}
            cpu_us = {name: 1e6 * statistics.median(cpu for _, cpu in r) / count for name, r in runs.items()}
            rows.append((tokens, sample_bytes, rate["raw"], rate["buffer"], cpu_us["raw"], cpu_us["buffer"]))
    finally:
        buffer.stop()
        relay.terminate()
        relay.wait(10)

    print(f"\nPut -> Pull -> Ack over loopback, {PRODUCERS} producers x {args.inflight} Puts in flight x "
          f"{SAMPLES_PER_PUT} samples/Put, batches of {SAMPLES_PER_PUT}, median of {repeats}")
    print(f"{'tokens':>7} {'KB/sample':>10} {'raw samples/s':>14} {'raw MB/s':>9} {'buffer samples/s':>17} "
          f"{'buffer MB/s':>12} {'ratio':>6} {'server CPU us/sample raw|buffer':>32}")
    for tokens, sample_bytes, raw_rate, buffer_rate, raw_cpu, buffer_cpu in rows:
        print(f"{tokens:>7} {sample_bytes / 1e3:>10.1f} {raw_rate:>14.0f} {raw_rate * sample_bytes / 1e6:>9.1f} "
              f"{buffer_rate:>17.0f} {buffer_rate * sample_bytes / 1e6:>12.1f} {buffer_rate / raw_rate:>6.2f} "
              f"{raw_cpu:>22.0f} | {buffer_cpu:<7.0f}")
    for tokens, sample_bytes, raw_rate, buffer_rate, *_ in rows:
        print(f"result: buffer_samples_per_s_{tokens // 1024}k = {buffer_rate:.0f} "
              f"(baseline raw gRPC relay {raw_rate:.0f}/s, target >= 0.7 of it)")
    for tokens, _, raw_rate, buffer_rate, *_ in rows:
        print(f"result: buffer_vs_raw_ratio_{tokens // 1024}k = {buffer_rate / raw_rate:.2f} "
              f"(baseline raw gRPC relay of the same bytes, target >= 0.7, fsync=batch)")


if __name__ == "__main__":
    main()
