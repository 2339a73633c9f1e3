"""Mixture-of-experts: how often the trainer's routers disagree with a bf16 rollout's, what routing replay (R3) does to
the rollout-vs-trainer logprob mismatch and costs a step, and the native MoE layer's speed against transformers'.

A tiny Qwen3-MoE is built in code (bfloat16 checkpoint: the engine and the trainer hold the same weights, the trainer
upcasts them to float32). The native engine generates in bfloat16 and records each token's routes; the trainer
(transformers, float32, as on the CPU) scores the same tokens with its own routing and with the rollout's replayed.

- router_agreement_bf16: of the (token, sparse layer) pairs, the share where the float32 trainer's own top-k set is the
  bf16 rollout's (R3 off; must be < 1, else this bench measures nothing);
- mismatch_abs_mean_r3_vs_off: mean |trainer - rollout logprob| over the response tokens with R3, over the same
  without (same engine, trainer and batch; < 1: replay narrows it);
- r3_step_overhead: a GRPO optimizer step's time with replay over without (the same batch, alternated, fastest);
- native_moe_layer_vs_transformers: tokens/s of rollout/model/moe.py's SparseMoeBlock over transformers'
  Qwen3MoeSparseMoeBlock (its experts_implementation printed), same weights and shape, CPU, inference.

    python bench/moe.py [--quick]
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
import torch

from protos.sample import Sample
from rollout.config import EngineConfig, MoeConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.model.moe import SparseMoeBlock
from rollout.model.tiny import write_tiny_model
from trainer.batch import collate
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.model import load_policy, run_policy
from trainer.parallel import DistEnv

SHAPE = {"arch": "qwen3_moe", "hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
         "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128}


def rollout_samples(folder: Path, prompts: list[list[int]], tokens: int) -> list[Sample]:
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="bfloat16", max_model_len=256))
    outputs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=7))
    samples = []
    for i, output in enumerate(outputs):
        completion = output.completions[0]
        n = len(completion.token_ids)
        samples.append(Sample(
            sample_id=f"s{i}", prompt_id=f"p{i // 4}", group_size=4, prompt_ids=np.asarray(output.prompt_ids, np.int32),
            response_ids=np.asarray(completion.token_ids, np.int32), loss_mask=np.ones(n, np.uint8),
            rollout_logprobs=np.asarray(completion.logprobs, np.float32), weight_versions=np.zeros(n, np.int64),
            reward=float(i % 2), temperature=1.0, routed_experts=completion.routed_experts))
    return samples


def agreement_and_mismatch(folder: Path, samples: list[Sample]) -> tuple[float, float, float]:
    """(router agreement without replay, mean |trainer - rollout| without replay, with replay)."""
    policy = load_policy(folder)
    batch = collate(samples)
    mask = batch.loss_mask.bool()
    gaps = {}
    with torch.no_grad():
        for replay in (False, True):
            logprobs = run_policy(policy, batch.input_ids, batch.attention_mask, batch.temperatures,
                                  routes=batch.routed_experts, replay=replay).logprobs
            gaps[replay] = float((logprobs - batch.rollout_logprobs)[mask].abs().mean())
            if not replay:
                hooks = policy.router_hooks
                own = torch.stack(hooks.own, 1).view(*batch.input_ids.shape, len(hooks.own), -1)
    routed = (batch.routed_experts >= 0).all(-1)  # [rows, tokens, layers]
    same = (own.sort(-1).values == batch.routed_experts.long().sort(-1).values).all(-1)
    return float(same[routed].double().mean()), gaps[False], gaps[True]


def step_overhead(folder: Path, samples: list[Sample], repeats: int) -> tuple[float, float]:
    """The fastest of `repeats` GRPO steps without and with replay, the two learners alternated, each first half the
    time (the fastest: on a shared machine the others' load only ever adds)."""
    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    learners = {}
    for mode in ("off", "rollout"):
        config = TrainerConfig.model_validate({
            "model_path": str(folder), "optim": {"lr": 1e-6}, "algorithm": {"name": "grpo"},
            "batch": {"global_batch_size": len(samples), "micro_batch_size": len(samples)},
            "moe": {"routing_replay": mode}})
        learner = Learner(config, env)
        learners[mode] = (learner, learner.prepare(samples)[0])
    times: dict[str, list[float]] = {"off": [], "rollout": []}
    for step in range(repeats + 1):
        for mode in ("off", "rollout") if step % 2 else ("rollout", "off"):  # each goes first half the time
            learner, batch = learners[mode]
            start = time.perf_counter()
            learner.train_step(batch, step)
            if step:  # the first is warm-up
                times[mode].append(time.perf_counter() - start)
    return min(times["off"]), min(times["rollout"])


def layer_speed(folder: Path, tokens: int, repeats: int) -> tuple[float, float, str]:
    """tokens/s of the native SparseMoeBlock and of transformers' block on the same weights and input."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    block = hf.model.layers[0].mlp
    raw = hf.config.to_dict()
    moe = MoeConfig.from_raw({**raw, "num_experts": hf.config.num_experts})
    native = SparseMoeBlock(hf.config.hidden_size, moe, torch.float32, torch.device("cpu"))
    native.load_state_dict(block.state_dict())
    x = torch.randn(tokens, hf.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.allclose(native(x), block(x[None])[0], atol=1e-5)

        def rate(fn) -> float:
            fn()
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            return tokens * repeats / (time.perf_counter() - start)

        return rate(lambda: native(x)), rate(lambda: block(x[None])), str(hf.config._experts_implementation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts, tokens and repeats")
    args = parser.parse_args()
    torch.set_num_threads(1)
    count, tokens, repeats = (8, 16, 3) if args.quick else (16, 48, 7)
    prompts = [[1, *range(10 + 3 * i, 26 + 3 * i)] for i in range(count)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_model(Path(tmp) / "moe", seed=3, dtype="bfloat16", **SHAPE)
        samples = rollout_samples(folder, prompts, tokens)
        agreement, off, r3 = agreement_and_mismatch(folder, samples)
        step_off, step_r3 = step_overhead(folder, samples, repeats)
        native, transformers_rate, implementation = layer_speed(folder, 512, 20 if args.quick else 50)
    print(f"\ntiny Qwen3-MoE ({SHAPE['num_layers']} layers, {SHAPE['num_experts']} experts, top "
          f"{SHAPE['num_experts_per_tok']}), {count} completions of {tokens} tokens, bf16 engine, float32 trainer, CPU")
    print(f"result: router_agreement_bf16 = {agreement:.4f} (baseline 1.0: a float32 trainer routing as the bf16 "
          "rollout did; R3 off)")
    print(f"result: mismatch_abs_mean_r3_vs_off = {r3 / off:.3f} (baseline R3 off: mean |d| {off:.4g}; with R3 "
          f"{r3:.4g})")
    print(f"result: r3_step_overhead = {step_r3 / step_off:.3f} (baseline the step without replay: {step_off * 1e3:.1f} "
          f"ms; with {step_r3 * 1e3:.1f} ms; fastest of {repeats})")
    print(f"result: native_moe_layer_vs_transformers = {native / transformers_rate:.2f} (baseline transformers' "
          f"Qwen3MoeSparseMoeBlock, experts_implementation {implementation}: {transformers_rate:,.0f} tokens/s; "
          f"native {native:,.0f} tokens/s; 512 tokens)")


if __name__ == "__main__":
    main()
