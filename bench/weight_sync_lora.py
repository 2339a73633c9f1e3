"""Adapter-only publish (a LoRA policy) against whole publishes, for bench/weight_sync.py's rows
lora_publish_bytes_vs_full, lora_publish_s_vs_full and lora_engine_pause_s.

The model is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads of 64, 2 KV heads, MLP 4864, vocabulary 151,936,
tied embeddings), random weights (seeded; a tiny tokenizer: the shape is what counts), rank 16 adapters on every
linear layer of the decoder (trainer/lora.py), published in bfloat16 to one in-process rollout engine serving
bfloat16 (AsyncEngine + WeightReceiver gRPC server, gloo over loopback). Each version moves every adapter element
(what an optimizer step does); `versions` adapter publishes (trainer/adapter_publish.py: the base once, then the
adapter alone; the receiver merges W + B @ A) are followed by as many whole publishes of the merged model (what full
fine-tuning sends). The rows are the sums, over the versions after the first, of bytes and of publish seconds,
adapter over whole, and the engine's mean pause per version of each kind.
"""

import asyncio
import json
import pathlib
import time

import torch

SHAPE = {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "head_dim": 64,
         "intermediate_size": 4864, "tie_word_embeddings": True}
VOCAB = 151_936
RANK = 16


def write_half_billion(folder: pathlib.Path) -> pathlib.Path:
    """Qwen2.5-0.5B's shape with random weights: the tiny kit's decoder, its embedding widened to the vocabulary."""
    from safetensors.torch import load_file, save_file

    from rollout.model.tiny import write_tiny_model

    write_tiny_model(folder, **SHAPE, seed=0)
    tensors = load_file(folder / "model.safetensors")
    generator = torch.Generator().manual_seed(1)
    tensors["model.embed_tokens.weight"] = torch.randn(VOCAB, SHAPE["hidden_size"], generator=generator) * 0.02
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB}))
    return folder


async def _measure(model_dir: pathlib.Path, versions: int) -> dict[str, float]:
    from bench.weight_sync_delta import _serve
    from trainer.adapter_publish import AdapterWeights
    from trainer.broadcast.broadcaster import WeightBroadcaster
    from trainer.broadcast.config import BroadcastConfig
    from trainer.config.model import ModelConfig
    from trainer.lora import merged_state
    from trainer.parallel import DistEnv, build_policy

    env = DistEnv(0, 1, torch.device("cpu"))
    policy = build_policy(model_dir, env, None, ModelConfig(lora={"rank": RANK, "alpha": 32.0}))
    weights = AdapterWeights(policy, env, torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    adapters = [p for name, p in policy.named_parameters() if "lora_" in name]
    engine, server, address = await _serve(model_dir)
    totals = {"lora_bytes": 0, "full_bytes": 0, "lora_s": 0.0, "full_s": 0.0, "lora_pause_s": 0.0, "full_pause_s": 0.0,
              "fallbacks": 0, "adapter_params": sum(p.numel() for p in adapters),
              "params": sum(p.numel() for name, p in policy.named_parameters() if "lora_" not in name)}
    try:
        kinds = (("lora", BroadcastConfig(dtype="bfloat16", adapter=True, timeout_s=300)),
                 ("full", BroadcastConfig(dtype="bfloat16", timeout_s=300)))
        version = 0
        for kind, config in kinds:
            async with WeightBroadcaster([address], config) as broadcaster:
                for index in range(versions + 1):
                    with torch.no_grad():
                        for parameter in adapters:
                            parameter.add_(torch.randn(parameter.shape, generator=generator) * 1e-3)
                    tensors = weights()
                    if kind == "full":  # the merged model (B is published pre-scaled)
                        tensors = merged_state(tensors, 1.0)
                    version += 1
                    started = time.perf_counter()
                    report = await broadcaster.publish(tensors, version)
                    elapsed = time.perf_counter() - started
                    assert report.ok, report.failed
                    if index:  # the first publish of each kind is whole
                        totals[f"{kind}_bytes"] += report.bytes
                        totals[f"{kind}_s"] += elapsed
                        totals[f"{kind}_pause_s"] += report.pause_s / versions
                    if kind == "lora":
                        totals["fallbacks"] = report.fallbacks
    finally:
        await server.stop(1)
        engine.shutdown()
    return totals


def measure_lora(folder: pathlib.Path, versions: int) -> dict[str, float]:
    """Totals over `versions` versions after the first: bytes, seconds and engine pauses, adapter and whole."""
    return asyncio.run(_measure(write_half_billion(folder), versions))
