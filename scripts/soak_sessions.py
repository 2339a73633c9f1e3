"""Soak the rollout service with concurrent multi-turn sessions; report memory (RSS) and KV blocks over time.

    python scripts/soak_sessions.py [--sessions 64] [--duration-s 600] [--json]

Starts a rollout process on loopback with a tiny model built in code, then keeps `--sessions` episodes
running at once (open, 2-6 turns of generate + append, close; then the next) for `--duration-s`. Every
`--sample-s` it reads the process's RSS (/proc) and its KV gauges (Prometheus /metrics). At the end, with
every session closed, the free KV blocks must equal those before the first session: no block leaked.
Prints a table, and one JSON line with --json (tests/test_sessions_soak.py runs a short soak).
"""

import argparse
import asyncio
import json
import pathlib
import random
import sys
import tempfile
import time
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from protos import rollout_pb2, rollout_pb2_grpc
from services.client import connect

GAUGES = ("relayrl_rollout_free_kv_blocks", "relayrl_rollout_open_sessions", "relayrl_rollout_session_kv_blocks",
          "relayrl_rollout_session_kv_evictions", "relayrl_rollout_prefill_tokens")


def rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def gauges(metrics_port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in GAUGES:
            values[name.removeprefix("relayrl_rollout_")] = float(value)
    return values


async def episode(stub, rng: random.Random, counts: dict) -> None:
    opened = await stub.OpenSession(rollout_pb2.OpenSessionRequest(prompt_text=f"task {rng.randrange(1000)}:",
                                                                   add_bos=True), timeout=60)
    for turn in range(rng.randint(2, 6)):
        async for _ in stub.GenerateInSession(rollout_pb2.GenerateInSessionRequest(
                session_id=opened.session_id, params=rollout_pb2.SamplingParams(max_tokens=8, temperature=1.0)),
                timeout=60):
            pass
        await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
            session_id=opened.session_id, text=f" obs {turn} {rng.randrange(100)};", turn_reward=0.0), timeout=60)
        counts["turns"] += 1
    await stub.CloseSession(rollout_pb2.CloseSessionRequest(session_id=opened.session_id, reward=1.0), timeout=60)
    counts["episodes"] += 1


async def soak(address: str, pid: int, metrics_port: int, sessions: int, duration_s: float, sample_s: float) -> dict:
    counts = {"episodes": 0, "turns": 0}
    samples = []
    before = gauges(metrics_port)
    deadline = time.monotonic() + duration_s
    async with connect(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)

        async def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < deadline:
                await episode(stub, rng, counts)

        async def sampler() -> None:
            started = time.monotonic()
            while time.monotonic() < deadline:
                await asyncio.sleep(sample_s)
                samples.append({"t": round(time.monotonic() - started, 1), "rss_mb": round(rss_mb(pid), 1),
                                **gauges(metrics_port), **counts})

        await asyncio.gather(sampler(), *(worker(i) for i in range(sessions)))
    after = gauges(metrics_port)
    half = samples[len(samples) // 2:] or samples
    first = samples[: max(1, len(samples) // 2)]
    return {
        "sessions": sessions, "duration_s": duration_s, **counts,
        "rss_mb_first_half_max": max(s["rss_mb"] for s in first),
        "rss_mb_second_half_max": max(s["rss_mb"] for s in half),
        "session_blocks_max": max(s["session_kv_blocks"] for s in samples),
        "free_blocks_before": before["free_kv_blocks"], "free_blocks_after": after["free_kv_blocks"],
        "open_sessions_after": after["open_sessions"], "evictions": after["session_kv_evictions"],
        "samples": samples,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--num-blocks", type=int, default=128,
                        help="KV blocks of 16 tokens (fewer than the sessions hold at once: evictions)")
    parser.add_argument("--json", action="store_true", help="print one JSON line at the end")
    args = parser.parse_args()

    from deploy.local.service_process import start_service
    from rollout.model.tiny import write_tiny_model

    with tempfile.TemporaryDirectory(prefix="relayrl-soak-") as tmp:
        model = write_tiny_model(pathlib.Path(tmp) / "model", seed=0)
        service = start_service("rollout", {
            "model": str(model), "engine.max_model_len": 256, "engine.num_blocks": args.num_blocks,
            "engine.torch_threads": 1, "engine.max_sessions": args.sessions * 2, "server.metrics_port": 0,
        }, log_dir=pathlib.Path(tmp) / "logs")
        try:
            report = asyncio.run(soak(service.address, service.pid, service.metrics_port, args.sessions,
                                      args.duration_s, args.sample_s))
        finally:
            service.stop(timeout=10)
    print(f"{'t (s)':>7} {'RSS MB':>8} {'free blk':>9} {'sess blk':>9} {'open':>5} {'episodes':>9} {'turns':>7}")
    for s in report["samples"]:
        print(f"{s['t']:>7} {s['rss_mb']:>8} {s['free_kv_blocks']:>9.0f} {s['session_kv_blocks']:>9.0f} "
              f"{s['open_sessions']:>5.0f} {s['episodes']:>9} {s['turns']:>7}")
    leaked = report["free_blocks_before"] - report["free_blocks_after"]
    print(f"{report['episodes']} episodes, {report['turns']} turns by {args.sessions} concurrent sessions in "
          f"{args.duration_s:g} s; RSS max {report['rss_mb_first_half_max']} MB (first half) -> "
          f"{report['rss_mb_second_half_max']} MB (second half); KV blocks leaked after close: {leaked:g}; "
          f"idle-session KV evictions: {report['evictions']:g}")
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k != "samples"}))
    return 0 if leaked == 0 and report["open_sessions_after"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
