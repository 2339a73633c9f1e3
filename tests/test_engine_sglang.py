"""The SGLang engine behind the engine interface (rollout/engines/sglang_engine.py), against the native engine.

GPU only (SGLang's kernels are CUDA's): marked gpu, skipped without CUDA or without sglang (`pip install -e
'.[sglang]'` on the GPU machine). Both engines run the same float32 checkpoint on the GPU.
"""

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu
sglang = pytest.importorskip("sglang")

from rollout.async_engine import AsyncEngine
from rollout.config import EngineConfig
from rollout.engine import LLMEngine
from rollout.engines.settings import SglangSettings
from rollout.engines.sglang_engine import SglangEngine
from rollout.sampling_params import SamplingParams

PROMPTS = [[5, 17, 33, 2, 60], [70, 71, 72], [9] * 12]


def _new_weights(model_dir, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.state_dict()


def test_sglang_after_a_weight_update_matches_the_native_engine(sharp_model_dir):
    """After one update through the adapter both engines give the same greedy tokens, logprobs within 1e-3
    (different GPU kernels), every token at version 1; abort ends a request with its partial output."""
    state = _new_weights(sharp_model_dir, seed=1)

    async def main():
        native = AsyncEngine(LLMEngine(EngineConfig(model=str(sharp_model_dir), device="cuda", max_model_len=128)))
        engine = SglangEngine(str(sharp_model_dir), SglangSettings(type="sglang", dtype="float32", max_model_len=128,
                                                                   mem_fraction_static=0.3))
        try:
            assert engine.parameter_layout().keys() == native.parameter_layout().keys()
            cuda_state = {name: t.cuda() for name, t in state.items()}
            await native.update_weights(cuda_state, 1)
            await engine.update_weights(cuda_state, 1)
            greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            for i, prompt in enumerate(PROMPTS):
                [mine] = await native.generate_all(f"n{i}", prompt, greedy)
                [other] = await engine.generate_all(f"s{i}", prompt, greedy)
                assert other.token_ids == mine.token_ids
                assert max(abs(a - b) for a, b in zip(mine.logprobs, other.logprobs)) < 1e-3
                assert set(other.weight_versions) == {1}
            scored, version = await engine.compute_logprobs(PROMPTS[0], [mine.token_ids], 1.0)
            expected, _ = await native.compute_logprobs(PROMPTS[0], [mine.token_ids], 1.0)
            assert version == 1 and max(abs(a - b) for a, b in zip(scored[0], expected[0])) < 1e-3

            long = SamplingParams(temperature=1.0, max_tokens=100, ignore_eos=True, seed=3)
            task = asyncio.ensure_future(engine.generate_all("long", PROMPTS[1], long))
            await asyncio.sleep(0.05)
            assert await engine.abort("long")
            [aborted] = await task
            assert aborted.finish_reason.value == "abort" and len(aborted.token_ids) < 100
        finally:
            engine.shutdown()
            native.shutdown()

    asyncio.run(main())
