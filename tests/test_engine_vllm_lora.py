"""vLLM serving LoRA unmerged (lora.mode unmerged: rollout/engines/lora_versions.py, rollout/engines/vllm_engine.py):
adapter versions loaded from the update's tensors through vLLM's LoRARequest, a request pinned to the version it
started on, against the native engine serving the same adapters unmerged. Real vLLM (the CPU build: `make test-vllm`);
skipped where vllm is not importable."""

import asyncio

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from rollout.config import EngineConfig
from rollout.engine.async_engine import AsyncEngine
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.engines.settings import VllmSettings
from rollout.engines.vllm_engine import start_vllm

PROMPT = [5, 17, 33, 2, 60, 9, 9, 41]
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(autouse=True)
def vllm_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.getbasetemp() / "vllm-cache"))


def _adapters(model_dir, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """Rank-`rank` adapters on every projection, as a LoRA trainer publishes them (B pre-scaled)."""
    from transformers import AutoModelForCausalLM

    from tests.test_lora_versions import random_adapters

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return random_adapters(model, rank, seed, targets=MODULES, scale=0.2)


def test_a_request_finishes_on_the_adapter_version_it_started_on(sharp_model_dir):
    """vLLM takes adapter versions 1 and 2 from tensors; a greedy request that started on version 1 while version 2
    arrived finishes on version 1 (every token tagged 1, tokens and logprobs those of the native engine with version
    1's adapter); a request after it runs on version 2 (the native engine's version-2 tokens); after versions 3 and 4
    only the newest two stay loaded in vLLM, and their PEFT folders alone remain. Scoring uses the served adapter."""
    a1, a2 = _adapters(sharp_model_dir, 1), _adapters(sharp_model_dir, 2)
    greedy = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)

    async def main():
        vllm = start_vllm(str(sharp_model_dir), VllmSettings(
            type="vllm", max_model_len=256, max_num_seqs=4,
            lora={"mode": "unmerged", "versions_resident": 2, "max_rank": 8}))
        native = AsyncEngine(LLMEngine(EngineConfig(model=str(sharp_model_dir), max_model_len=256,
                                                    lora={"mode": "unmerged", "versions_resident": 3})))
        try:
            [plain] = await vllm.generate_all("plain", PROMPT, greedy)
            await vllm.update_weights(a1, 1)
            await native.update_weights(a1, 1)
            [expected_v1] = await native.generate_all("n1", PROMPT, greedy)

            stream = vllm.generate("pinned", PROMPT, greedy)
            first = await anext(stream)
            tokens, logprobs, versions = list(first.token_ids), list(first.logprobs), list(first.weight_versions)
            await vllm.update_weights(a2, 2)
            assert vllm.stats["running"] == 1  # version 2 arrived while the request ran
            async for delta in stream:
                tokens += delta.token_ids
                logprobs += delta.logprobs
                versions += delta.weight_versions
            assert len(tokens) == 150 and set(versions) == {1}
            assert tokens == expected_v1.token_ids and tokens != plain.token_ids  # the adapter matters
            assert max(abs(a - b) for a, b in zip(logprobs, expected_v1.logprobs)) < 1e-3

            await native.update_weights(a2, 2)
            [expected_v2] = await native.generate_all("n2", PROMPT, greedy)
            [after] = await vllm.generate_all("after", PROMPT, greedy)
            assert set(after.weight_versions) == {2} and after.token_ids == expected_v2.token_ids
            assert after.token_ids != tokens
            for temperature in (1.0, 0.7):  # scoring uses the served version's adapter too
                [mine], _ = await native.compute_logprobs(PROMPT, [after.token_ids], temperature)
                [theirs], version = await vllm.compute_logprobs(PROMPT, [after.token_ids], temperature)
                assert version == 2 and max(abs(a - b) for a, b in zip(mine, theirs)) < 1e-3, temperature

            core = vllm.engine
            await vllm.update_weights(_adapters(sharp_model_dir, 3), 3)
            await vllm.update_weights(_adapters(sharp_model_dir, 4), 4)
            assert sorted(core.adapters.resident) == [3, 4] and vllm.stats["lora_versions_resident"] == 2
            assert sorted(core.llm.list_loras()) == sorted(lora_id for lora_id, _ in core.adapters.resident.values())
            assert sorted(p.name for p in core.adapters.root.iterdir()) == ["v3", "v4"]
        finally:
            vllm.shutdown()
            native.shutdown()

    asyncio.run(main())


def test_adapter_only_publish_to_a_vllm_rollout_service_serves_each_version_unmerged(sharp_model_dir, service_factory):
    """A LoRA trainer's publishes (the base once, then the adapter alone: trainer/broadcast/adapter.py) over gloo to a
    rollout service process running vLLM with lora.mode unmerged: each version's greedy tokens equal transformers +
    peft's with that adapter and carry the version; the updates after the first are partial, the adapter's bytes."""
    from tests.test_weight_sync_lora import lora_policy, publish_adapter_versions
    from trainer.adapter_publish import AdapterWeights
    from trainer.parallel import DistEnv

    rollout = service_factory("rollout", {"model": str(sharp_model_dir), "server.metrics_port": 0, "engine": {
        "type": "vllm", "max_model_len": 256, "max_num_seqs": 4, "lora": {"mode": "unmerged", "max_rank": 8}}})
    policy = lora_policy(sharp_model_dir)
    weights = AdapterWeights(policy, DistEnv(0, 1, torch.device("cpu")), None)

    reports, served = publish_adapter_versions(rollout.address, policy, weights, versions=3)
    for version, ((tokens, tagged), expected) in enumerate(served, start=1):
        assert tagged == version and tokens == expected, version
    assert len({tuple(expected) for _, expected in served}) > 1  # the versions differ
    assert not reports[0].partial
    adapter_bytes = sum(t.numel() * t.element_size() for name, t in weights().items() if "lora_" in name)
    for report in reports[1:]:
        assert report.partial and report.fallbacks == 0 and adapter_bytes <= report.bytes < 1.01 * adapter_bytes
