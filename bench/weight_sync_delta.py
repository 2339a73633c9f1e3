"""Delta sync against whole publishes, for bench/weight_sync.py's rows delta_publish_bytes_vs_full and
delta_publish_s_vs_full.

A float32 Qwen2 decoder (the bench's shape) takes real AdamW steps (lr 1e-6, next-token loss on random tokens); after
each step it is published in bfloat16 to two in-process rollout engines serving bfloat16 (AsyncEngine + WeightReceiver
gRPC servers, gloo over loopback): one by a broadcaster with `delta: auto`, one by a broadcaster with `delta: off`.
The rows are the sums over the steps of bytes sent and of publish seconds, delta over whole; the engines' weights are
checked bit-identical to the trainer's cast at the end.
"""

import asyncio
import pathlib
import time

import torch


async def _serve(model_dir: pathlib.Path):
    from protos import weights_pb2_grpc
    from rollout.config import EngineConfig
    from rollout.engine.async_engine import AsyncEngine
    from rollout.engine.llm_engine import LLMEngine
    from rollout.serve.weight_receiver import WeightReceiver
    from services.server import create_server

    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_blocks=64, max_num_seqs=2, max_n=2,
                                                dtype="bfloat16")))
    receiver = WeightReceiver(engine, layout=engine.parameter_layout())
    server, port = await create_server(
        "127.0.0.1:0", [(weights_pb2_grpc.add_WeightSyncServicer_to_server, receiver, "relayrl.weights.v1.WeightSync")])
    await server.start()
    return engine, server, f"127.0.0.1:{port}"


async def _measure(model_dir: pathlib.Path, steps: int, lr: float) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from trainer.broadcast.broadcaster import WeightBroadcaster
    from trainer.broadcast.config import BroadcastConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    generator = torch.Generator().manual_seed(0)
    served = [await _serve(model_dir) for _ in range(2)]
    totals = {"delta_bytes": 0, "full_bytes": 0, "delta_s": 0.0, "full_s": 0.0, "fallbacks": 0}
    try:
        delta = WeightBroadcaster([served[0][2]], BroadcastConfig(dtype="bfloat16", delta="auto", timeout_s=120))
        full = WeightBroadcaster([served[1][2]], BroadcastConfig(dtype="bfloat16", delta="off", timeout_s=120))
        async with delta, full:
            for version in range(1, steps + 2):
                if version > 1:
                    tokens = torch.randint(0, model.config.vocab_size, (2, 33), generator=generator)
                    model(input_ids=tokens, labels=tokens).loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
                state = model.state_dict()
                reports = []
                for broadcaster in (delta, full):
                    started = time.perf_counter()
                    reports.append(await broadcaster.publish(state, version))
                    reports[-1].total_s = time.perf_counter() - started
                    assert reports[-1].ok, reports[-1].failed
                if version > 1:  # the first publish is whole for both
                    totals["delta_bytes"] += reports[0].bytes
                    totals["full_bytes"] += reports[1].bytes
                    totals["delta_s"] += reports[0].total_s
                    totals["full_s"] += reports[1].total_s
                totals["fallbacks"] = reports[0].fallbacks
        for engine, _, _ in served:
            for name, param in engine.engine.runner.model.named_parameters():
                assert torch.equal(param, state[name].to(torch.bfloat16)), name
    finally:
        for engine, server, _ in served:
            await server.stop(1)
            engine.shutdown()
    return totals


def measure_delta(model_dir: pathlib.Path, steps: int, lr: float = 1e-6) -> dict[str, float]:
    """Totals over `steps` AdamW steps: bytes and publish seconds of delta and whole publishes, and the fallbacks."""
    return asyncio.run(_measure(model_dir, steps, lr))
