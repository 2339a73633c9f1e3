"""Adapter-only publish (a LoRA policy) against whole publishes, for bench/weight_sync.py's rows
lora_publish_bytes_vs_full, lora_publish_s_vs_full and lora_engine_pause_s.

The model is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads of 64, 2 KV heads, MLP 4864, vocabulary 151,936,
tied embeddings), random weights (seeded; a tiny tokenizer: the shape is what counts), rank 16 adapters on every
linear layer of the decoder (trainer/lora.py), published in bfloat16 to one in-process rollout engine serving
bfloat16 (AsyncEngine + WeightReceiver gRPC server, gloo over loopback). Each version moves every adapter element
(what an optimizer step does); `versions` adapter publishes (trainer/adapter_publish.py: the base once, then the
adapter alone; the receiver merges W + B @ A) are followed by as many whole publishes of the merged model (what full
fine-tuning sends). The rows are the sums, over the versions after the first, of bytes and of publish seconds,
adapter over whole, and the engine's mean pause per version of each kind. The in-process engine serves the adapters
unmerged (its default, rollout/model/lora.py): an adapter version lands in place in the buffers it serves W from.

measure_decode (row native_lora_decode_tokens_per_s_vs_merged): decode tokens/s of the native engine serving one
rank-16 adapter version unmerged (y = W x + B (A x)) against the same model with the adapter merged into W, at batch
16 (16 prompts of 8 tokens decoded together, greedy), the two engines run alternately `repeats` times, median ratio.
"""

import asyncio
import json
import pathlib
import statistics
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


def _random_adapters(model_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    """Rank-RANK adapters on every linear layer of the decoder (B pre-scaled, as published), seeded."""
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(2)
    adapters = {}
    for name, weight in load_file(model_dir / "model.safetensors").items():
        if ".layers." in name and name.endswith("_proj.weight"):
            module = name.removesuffix(".weight")
            adapters[f"{module}.lora_A.weight"] = torch.randn(RANK, weight.shape[1], generator=generator) * 0.02
            adapters[f"{module}.lora_B.weight"] = torch.randn(weight.shape[0], RANK, generator=generator) * 0.02
    return adapters


def _decode_tokens_per_s(engine, batch: int, tokens: int) -> float:
    """Decode tokens/s of `batch` greedy completions of 8-token prompts (the prefill step not timed)."""
    from rollout.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    for index in range(batch):
        engine.add_request(f"r{time.monotonic_ns()}-{index}", [1, *range(10 + index, 17 + index)], params)
    engine.step()  # every prompt's prefill, and its first token
    started, produced = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        produced += len(engine.step())
    return produced / (time.perf_counter() - started)


def measure_decode(folder: pathlib.Path, batch: int = 16, tokens: int = 16, repeats: int = 3) -> dict[str, float]:
    """Decode tokens/s at `batch`, unmerged adapter vs merged, at Qwen2.5-0.5B's shape (written to `folder` unless
    there); median over `repeats` alternating runs."""
    from safetensors.torch import load_file

    from rollout.config import EngineConfig
    from rollout.engine.llm_engine import LLMEngine

    model_dir = folder if (folder / "config.json").exists() else write_half_billion(folder)
    adapters = _random_adapters(model_dir)
    merged = {}
    for name, weight in load_file(model_dir / "model.safetensors").items():
        module = name.removesuffix(".weight")
        if f"{module}.lora_A.weight" in adapters:
            weight = weight.float() + adapters[f"{module}.lora_B.weight"] @ adapters[f"{module}.lora_A.weight"]
        merged[name] = weight
    blocks = batch * -(-(8 + tokens) // 16) + 4

    def engine(mode: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", max_model_len=256, num_blocks=blocks,
                                      max_num_seqs=batch, lora={"mode": mode}))

    unmerged_engine, merged_engine = engine("unmerged"), engine("merged")
    unmerged_engine.load_weights(adapters, 1)
    merged_engine.load_weights(merged, 1)
    runs = {"unmerged": [], "merged": []}
    for _ in range(repeats):
        runs["merged"].append(_decode_tokens_per_s(merged_engine, batch, tokens))
        runs["unmerged"].append(_decode_tokens_per_s(unmerged_engine, batch, tokens))
    ratios = [u / m for u, m in zip(runs["unmerged"], runs["merged"], strict=True)]
    return {"ratio": statistics.median(ratios), "unmerged": statistics.median(runs["unmerged"]),
            "merged": statistics.median(runs["merged"]), "batch": batch, "tokens": tokens, "repeats": repeats,
            "runs": runs, "ratios": ratios}
