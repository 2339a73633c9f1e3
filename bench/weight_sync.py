"""How long does publishing a new weight version take, against moving the same bytes with raw gloo?

For models of ~50 MB and ~400 MB (float32 Qwen2 decoders: hidden 512, as many layers as the size
takes) and 1, 2 and 4 receiver processes, one run measures:

  publish   what the trainer does when it holds its policy whole (one process, the default
            `publish.bind`): WeightBroadcaster.publish of parameters bound to one buffer laid out as a
            single bucket (WeightBroadcaster.bind) — BeginUpdate over gRPC, one broadcast straight from
            their memory over the kept-alive gloo group, CommitUpdate (each receiver's native engine
            switches to the received tensors between two steps; its CommitUpdate reply says how long it paused
            generating for it). Receivers are real rollout engines
            (AsyncEngine + WeightReceiver gRPC servers) in their own processes.
  snapshot  what an overlapped publish (`publish.overlap`) adds to the trainer's step instead of the
            whole publish: WeightBroadcaster.snapshot, one memcpy of the bound buffer, then the same send.
  packed    the same publish filled bucket by bucket as the buckets go out (ShardedWeights, what a trainer
            that does not bind sends: a sharded one gathers each tensor on its device into its slot; in
            this world of one, each tensor is copied into its slot of a 32 MiB bucket).
  raw gloo  ProcessGroupGloo.broadcast of one flat buffer of the same bytes to the same number of
            plain processes, then a barrier (so the time covers arrival everywhere). Each kind of publish
            alternates with its own raw rounds.
  copy      one in-memory Tensor.copy_ of the same bytes (a single thread).
  delta     `--delta-steps` (200; --quick 20) real AdamW steps at lr 1e-6 of the smallest model, each published in
            bfloat16 with `delta: auto` and whole, to engines serving bfloat16 (bench/weight_sync_delta.py): rows
            delta_publish_bytes_vs_full and delta_publish_s_vs_full.
  lora      `--lora-versions` (5; --quick 2) versions of a LoRA policy at Qwen2.5-0.5B's shape, rank 16 on every
            linear layer, published adapter-only and then whole (merged), in bfloat16 to an engine serving bfloat16
            (bench/weight_sync_lora.py): rows lora_publish_bytes_vs_full, lora_publish_s_vs_full, lora_engine_pause_s.
            The engine serves the adapters unmerged (its default): each version lands in place, W untouched.
  lora decode  the native engine decoding 16 completions together (`--lora-decode-tokens` each, 16) at the same shape
            with a rank-16 adapter on every linear layer served unmerged, against the same model with the adapter
            merged into W, run alternately (3 times; --quick once): row native_lora_decode_tokens_per_s_vs_merged.

Raw and publish rounds alternate, and medians are quoted, because the machine is shared.
`--quick` runs the 50 MB model with 1 and 2 receivers and few repeats (< 1 minute).

    python bench/weight_sync.py [--quick]
"""

import argparse
import asyncio
import datetime
import itertools
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HIDDEN = 512
HEAD_DIM = 64


def layers_for(total_mb: int) -> int:
    """Decoder layers of hidden HIDDEN (q/k/v/o HIDDEN x HIDDEN, MLP 2 x HIDDEN wide) making ~`total_mb` MiB."""
    h, ff = HIDDEN, 2 * HIDDEN
    layer_bytes = 4 * (4 * h * h + 3 * ff * h + 3 * h + 2 * h)
    return max(1, round(total_mb * (1 << 20) / layer_bytes))


def write_model(folder: pathlib.Path, total_mb: int) -> pathlib.Path:
    from rollout.model.tiny import write_tiny_model

    return write_tiny_model(folder, arch="qwen2", hidden_size=HIDDEN, num_layers=layers_for(total_mb),
                            num_heads=HIDDEN // HEAD_DIM, num_kv_heads=HIDDEN // HEAD_DIM, head_dim=HEAD_DIM,
                            intermediate_size=2 * HIDDEN, max_position_embeddings=64)


# -- receiver processes ----------------------------------------------------------------------------

def run_receiver(args) -> None:
    import torch

    from protos import weights_pb2_grpc
    from rollout.config import EngineConfig
    from rollout.engine.async_engine import AsyncEngine
    from rollout.engine.llm_engine import LLMEngine
    from rollout.serve.weight_receiver import WeightReceiver
    from services.config import ServerConfig
    from services.runtime import serve

    torch.set_num_threads(1)
    engine = AsyncEngine(LLMEngine(EngineConfig(model=args.model, num_blocks=8, max_num_seqs=2, max_n=1)))
    receiver = WeightReceiver(engine)
    registration = (weights_pb2_grpc.add_WeightSyncServicer_to_server, receiver, "relayrl.weights.v1.WeightSync")
    try:
        asyncio.run(serve("wsync-bench", [registration], ServerConfig(port_file=args.port_file, log_level="WARNING")))
    finally:
        engine.shutdown()


def run_raw_receiver(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", args.master_port, None, False, timeout=datetime.timedelta(seconds=120))
    pg = _raw_group(store, args.rank, args.world)
    command = torch.zeros(1, dtype=torch.int64)
    buffer = torch.empty(args.nbytes, dtype=torch.uint8)
    while True:
        pg.broadcast(command, 0).wait()
        if command.item() == 0:
            return
        pg.broadcast(buffer, 0).wait()
        pg.barrier().wait()


def _raw_group(store, rank: int, world: int):
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=120)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(dist.PrefixStore("raw/", store), rank, world, options)


# -- the measuring process -------------------------------------------------------------------------

def _spawn(*extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, __file__, *extra], env=env, cwd=ROOT)


def _wait_port(path: pathlib.Path, proc: subprocess.Popen, timeout: float = 120) -> int:
    import json

    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"receiver did not start (exit code {proc.poll()})")
        time.sleep(0.05)
    return json.loads(path.read_text())["port"]


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def measure_copy(nbytes: int, repeats: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


async def measure_pair(model: pathlib.Path, tensors: dict, receivers: int, repeats: int, config,
                       tmp: pathlib.Path) -> dict:
    """Start `receivers` rollout engines serving `model` and as many raw gloo processes; alternate raw
    and publish rounds of `tensors` (the model's state dict)."""
    import torch
    import torch.distributed as dist

    from trainer.broadcast.broadcaster import PublishReport, WeightBroadcaster
    from trainer.broadcast.gather import ShardedWeights

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    raw_procs = [_spawn("--role", "raw", "--master-port", str(store.port), "--rank", str(rank), "--world",
                        str(receivers + 1), "--nbytes", str(nbytes)) for rank in range(1, receivers + 1)]
    port_files = [tmp / f"recv-{model.name}-{receivers}-{i}.port" for i in range(receivers)]
    service_procs = [_spawn("--role", "receiver", "--model", str(model), "--port-file", str(path))
                     for path in port_files]
    try:
        raw_pg = await asyncio.to_thread(_raw_group, store, 0, receivers + 1)
        addresses = [f"127.0.0.1:{_wait_port(path, proc)}" for path, proc in zip(port_files, service_procs)]
        command, flat = torch.ones(1, dtype=torch.int64), torch.ones(nbytes, dtype=torch.uint8)

        def raw_round() -> float:
            raw_pg.broadcast(command, 0).wait()
            started = time.perf_counter()
            raw_pg.broadcast(flat, 0).wait()
            raw_pg.barrier().wait()
            return time.perf_counter() - started

        async def rounds(publish_tensors, bind: bool) -> tuple[list, list, PublishReport, list]:
            """Warm-up publishes, then `repeats` (raw round, publish) pairs on one kept group. `publish_tensors`: a
            dict, or a callable that makes what each publish sends."""
            if isinstance(publish_tensors, dict):
                held = publish_tensors
                publish_tensors = lambda: held
            measured, snapshots = [], []
            async with WeightBroadcaster(addresses, config) as broadcaster:
                if bind:
                    broadcaster.bind(publish_tensors())
                    broadcaster.snapshot()  # allocates its buffer
                    for _ in range(repeats):
                        started = time.perf_counter()
                        broadcaster.snapshot()
                        snapshots.append(time.perf_counter() - started)
                first = await broadcaster.publish(publish_tensors(), next(versions))  # forms the group
                assert first.ok, first.failed
                # The second publish allocates the second set of staging buffers (the engine serves the first).
                second = await broadcaster.publish(publish_tensors(), next(versions))
                assert second.ok, second.failed
                raw_round()
                for _ in range(repeats):
                    raw = await asyncio.to_thread(raw_round)
                    measured.append((raw, await broadcaster.publish(publish_tensors(), next(versions))))
                    assert measured[-1][1].ok and measured[-1][1].group_reused, measured[-1][1].failed
            return [raw for raw, _ in measured], [report for _, report in measured], first, snapshots

        versions = itertools.count(1)
        raw, reports, first, snapshots = await rounds({name: t.clone() for name, t in tensors.items()}, bind=True)
        # What a trainer that does not bind sends: each tensor gathered (here: a world of one, copied) into its
        # bucket as the bucket goes out (trainer/broadcast/gather.py).
        packed_raw, packed_reports, _, _ = await rounds(lambda: ShardedWeights(tensors, "cpu"), bind=False)
        publish = [report.total_s for report in reports]
        pauses = [report.pause_s for report in reports]
        parts = []
        for report in reports:
            switch_s = max(r.switch_s for r in report.results)
            parts.append((report.begin_s, report.transfer_s, report.commit_s, switch_s, report.total_s - switch_s))
        packed_publish = [report.total_s for report in packed_reports]
        command.zero_()
        raw_pg.broadcast(command, 0).wait()
        return {
            "bytes": nbytes, "raw": statistics.median(raw), "publish": statistics.median(publish),
            "first": first.total_s, "parts": [statistics.median(p) for p in zip(*parts)],
            "snapshot": statistics.median(snapshots), "pause": statistics.median(pauses),
            # Ratios of adjacent rounds share the machine's load of the moment: their median is steadier
            # than a ratio of medians on a shared machine.
            "ratio": statistics.median(r / p for r, p in zip(raw, publish)),
            "ratio_without_switch": statistics.median(r / p[-1] for r, p in zip(raw, parts)),
            "packed": statistics.median(packed_publish),
            "packed_ratio": statistics.median(r / p for r, p in zip(packed_raw, packed_publish)),
        }
    finally:
        _stop(service_procs)
        _stop(raw_procs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="50 MB, 1 and 2 receivers, 3 repeats")
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[50, 400])
    parser.add_argument("--receivers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=None, help="bucket size (default: BroadcastConfig's)")
    parser.add_argument("--solo-mb", type=float, default=None, help="tensors this large go alone (default: bucket)")
    parser.add_argument("--delta-steps", type=int, default=200, help="AdamW steps of the delta sync rows (0: none)")
    parser.add_argument("--lora-versions", type=int, default=5, help="versions of the LoRA rows (0: none)")
    parser.add_argument("--lora-decode-tokens", type=int, default=16,
                        help="tokens per completion of the native LoRA decode row, batch 16 (0: none)")
    parser.add_argument("--role", choices=["main", "receiver", "raw"], default="main", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    parser.add_argument("--master-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "receiver":
        return run_receiver(args)
    if args.role == "raw":
        return run_raw_receiver(args)
    if args.quick:
        args.sizes_mb, args.receivers, args.repeats, args.delta_steps = [50], [1, 2], 3, min(args.delta_steps, 20)
        args.lora_versions = min(args.lora_versions, 2)

    import torch

    from trainer.broadcast.config import BroadcastConfig

    sizes = {"bucket_mb": args.bucket_mb} if args.bucket_mb is not None else {}
    config = BroadcastConfig(**sizes, solo_mb=args.solo_mb, timeout_s=120, control_timeout_s=30)
    torch.set_num_threads(1)  # the receivers run one thread each; so does the copy baseline
    print(f"weight sync on {os.cpu_count()} CPU cores (all processes share them), torch {torch.__version__}, "
          f"gloo over loopback, buckets of {config.bucket_mb:g} MiB (tensors >= "
          f"{config.bucket_mb if config.solo_mb is None else config.solo_mb:g} MiB sent alone), median of {args.repeats}",
          flush=True)
    header = (f"{'model':>7} {'recv':>4} {'copy s':>7} {'raw gloo s':>10} {'publish s':>9} {'GB/s':>6} "
              f"{'begin':>6} {'xfer':>6} {'commit':>6} {'switch':>6} {'pause':>6} {'1st s':>6} {'raw/pub':>7} {'raw/(pub-sw)':>12} "
              f"{'copy/pub':>8} {'snapshot':>8} {'packed s':>8} {'raw/packed':>10}")
    print(header, flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="wsync-bench-") as tmp:
        for size_mb in args.sizes_mb:
            from safetensors.torch import load_file

            model = write_model(pathlib.Path(tmp) / f"qwen2-{size_mb}mb", size_mb)
            tensors = load_file(model / "model.safetensors")
            copy_s = measure_copy(sum(t.numel() * t.element_size() for t in tensors.values()), args.repeats)
            for receivers in args.receivers:
                row = asyncio.run(measure_pair(model, tensors, receivers, args.repeats, config, pathlib.Path(tmp)))
                ratio = row["ratio"]
                begin, transfer, commit, switch, _ = row["parts"]
                print(f"{row['bytes'] / 1e6:>5.0f}MB {receivers:>4} {copy_s:>7.3f} {row['raw']:>10.3f} "
                      f"{row['publish']:>9.3f} {row['bytes'] / row['publish'] / 1e9:>6.2f} {begin:>6.3f} "
                      f"{transfer:>6.3f} {commit:>6.3f} {switch:>6.3f} {row['pause']:>6.3f} {row['first']:>6.2f} {ratio:>7.2f} "
                      f"{row['ratio_without_switch']:>12.2f} {copy_s / row['publish']:>8.2f} {row['snapshot']:>8.3f} "
                      f"{row['packed']:>8.3f} {row['packed_ratio']:>10.2f}", flush=True)
                results.append((size_mb, receivers, ratio, row["packed_ratio"], row["pause"], row["publish"]))
        if args.delta_steps:
            from bench.weight_sync_delta import measure_delta

            delta_mb = min(args.sizes_mb)
            delta = measure_delta(write_model(pathlib.Path(tmp) / "delta", delta_mb), args.delta_steps)
        if args.lora_versions:
            from bench.weight_sync_lora import measure_lora

            lora = measure_lora(pathlib.Path(tmp) / "lora", args.lora_versions)
        if args.lora_decode_tokens:
            from bench.weight_sync_lora import measure_decode

            decode = measure_decode(pathlib.Path(tmp) / "lora", tokens=args.lora_decode_tokens,
                                    repeats=1 if args.quick else 3)
    print("raw/pub = median over rounds of raw gloo time / publish time of the adjacent round (1.0: publishing "
          "costs no more than the bare broadcast); "
          "raw/(pub-sw) = the same without the receivers' switch (the engine taking the staged tensors as its "
          "parameters, part of commit, which a raw broadcast does not do); 1st s = the first publish, which "
          "forms the group and allocates the staging buffers; pause = how long the engines generated nothing for "
          "the update (CommitUpdate's pause_s, the receivers' own measure, the longest of them), apart from the "
          "sync time (publish s), through which they generate; snapshot = the memcpy an overlapped publish puts "
          "on the trainer's step; packed s = a publish that fills each bucket as it goes out (ShardedWeights: the "
          "path of a sharded or casting trainer, which gathers each tensor into its slot; here a world of one, so "
          "a copy), raw/packed its ratio")
    for size_mb, receivers, ratio, packed_ratio, pause, sync in results:
        print(f"result: publish_vs_raw_gloo_{size_mb}mb_{receivers}recv = {ratio:.2f} "
              f"(baseline raw gloo broadcast of the same bytes, target >= 0.8)")
        print(f"result: publish_packed_vs_raw_gloo_{size_mb}mb_{receivers}recv = {packed_ratio:.2f} "
              f"(baseline raw gloo broadcast of the same bytes, target >= 0.8)")
        print(f"result: engine_pause_s_{size_mb}mb_{receivers}recv = {pause:.4f} (baseline the sync time, "
              f"{sync:.3f} s, through which the engines generate; target: a small share of it)")
    if args.delta_steps:
        what = (f"{args.delta_steps} AdamW steps at lr 1e-6 of the {delta_mb} MB float32 decoder (hidden {HIDDEN}, "
                f"random init, random tokens) served in bfloat16, 1 receiver, {delta['fallbacks']} fallbacks")
        print(f"result: delta_publish_bytes_vs_full = {delta['delta_bytes'] / delta['full_bytes']:.4f} "
              f"(baseline whole bfloat16 publishes, {what}; target <= 0.10)")
        print(f"result: delta_publish_s_vs_full = {delta['delta_s'] / delta['full_s']:.2f} (baseline whole publishes' "
              f"seconds, {what})")


    if args.lora_versions:
        what = (f"{args.lora_versions} versions after the first of Qwen2.5-0.5B's shape ({lora['params'] / 1e6:.0f}M "
                f"parameters, random init), rank 16 on every linear layer ({lora['adapter_params'] / 1e6:.2f}M), every "
                f"adapter element moved per version, bfloat16 to 1 engine, {lora['fallbacks']} fallbacks")
        print(f"result: lora_publish_bytes_vs_full = {lora['lora_bytes'] / lora['full_bytes']:.4f} (baseline whole "
              f"publishes of the merged model, {what}; target <= 0.02)")
        print(f"result: lora_publish_s_vs_full = {lora['lora_s'] / lora['full_s']:.3f} (baseline whole publishes' "
              f"seconds, {lora['full_s'] / args.lora_versions:.2f} s each; {what})")
        print(f"result: lora_engine_pause_s = {lora['lora_pause_s']:.4f} (baseline a whole publish's pause, "
              f"{lora['full_pause_s']:.4f} s; mean per version)")
    if args.lora_decode_tokens:
        print("native LoRA decode tokens/s, run by run (merged, unmerged, ratio): " + ", ".join(
            f"({m:.1f}, {u:.1f}, {r:.3f})" for m, u, r in zip(decode["runs"]["merged"], decode["runs"]["unmerged"],
                                                              decode["ratios"])))
        print(f"result: native_lora_decode_tokens_per_s_vs_merged = {decode['ratio']:.3f} (baseline the same model "
              f"with the adapter merged, {decode['merged']:.1f} tokens/s against {decode['unmerged']:.1f}; batch "
              f"{decode['batch']}, {decode['tokens']} tokens each, Qwen2.5-0.5B's shape float32 on the CPU, rank 16 on "
              f"every linear layer, median of {decode['repeats']} alternating runs; target >= 0.8)")


if __name__ == "__main__":
    main()
