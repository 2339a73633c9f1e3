"""vLLM's unmerged LoRA without vLLM (rollout/engines/lora_versions.py): the update's adapters as the PEFT folder a
LoRARequest names (read back by peft onto transformers' model, it gives W x + B (A x) with the published B), the
refusals, and which adapter versions stay resident. The engine itself runs in tests/test_engine_vllm_lora.py
(`make test-vllm`)."""

import json

import pytest
import torch

from rollout.engines.lora_versions import AdapterVersions, adapter_problem, peft_adapter, write_peft_folder
from rollout.engines.settings import VllmSettings

TARGETS = ("q_proj", "v_proj", "down_proj")


def random_adapters(model, rank: int, seed: int = 0, targets=TARGETS, scale: float = 0.3) -> dict[str, torch.Tensor]:
    """Published adapters of the model's `targets` (B pre-scaled, as trainer/adapter_publish.py sends it)."""
    generator = torch.Generator().manual_seed(seed)
    adapters = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets:
            out_features, in_features = module.weight.shape
            adapters[f"{name}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) * scale
            adapters[f"{name}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * scale
    return adapters


def test_the_peft_folder_read_by_peft_serves_w_plus_b_a_with_the_published_b(tiny_model_dir, tmp_path):
    """What vLLM loads is a PEFT adapter folder: peft reads ours onto transformers' model and its logits equal those
    of the model with W + B @ A written into its weights (lora_alpha = r: the published B is already scaled)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    adapters = random_adapters(model, rank=4)
    folder = write_peft_folder(tmp_path / "v3", adapters, max_rank=8)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 4 and sorted(config["target_modules"]) == sorted(TARGETS)

    ids = torch.tensor([[1, *range(10, 30)]])
    merged = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        plain = merged(ids).logits
        for name, module in merged.named_modules():
            if f"{name}.lora_A.weight" in adapters:
                module.weight += adapters[f"{name}.lora_B.weight"] @ adapters[f"{name}.lora_A.weight"]
        expected = merged(ids).logits
        served = PeftModel.from_pretrained(model, str(folder)).eval()(ids).logits
    assert (expected - plain).abs().max() > 0.1  # the adapter matters
    assert (served - expected).abs().max() < 1e-4


def test_adapters_vllm_cannot_serve_are_refused_naming_why():
    a, b = torch.zeros(4, 8), torch.zeros(16, 4)
    base = "model.layers.0.self_attn.q_proj"
    assert adapter_problem(base + ".weight") is None
    assert "merged" in adapter_problem("lm_head.weight")
    assert "merged" in adapter_problem("model.embed_tokens.weight")
    with pytest.raises(ValueError, match="exceeds engine.lora.max_rank 2"):
        peft_adapter({base + ".lora_A.weight": a, base + ".lora_B.weight": b}, max_rank=2)
    other = "model.layers.0.self_attn.k_proj"
    with pytest.raises(ValueError, match=r"one rank per adapter; the update has ranks \[2, 4\]"):
        peft_adapter({base + ".lora_A.weight": a, base + ".lora_B.weight": b,
                      other + ".lora_A.weight": torch.zeros(2, 8), other + ".lora_B.weight": torch.zeros(16, 2)}, 16)
    with pytest.raises(ValueError, match="needs both lora_A and lora_B"):
        peft_adapter({base + ".lora_A.weight": a}, 16)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        peft_adapter({}, 16)
    with pytest.raises(ValueError, match="versions_resident"):
        VllmSettings(type="vllm", lora={"mode": "unmerged", "versions_resident": 0})
    with pytest.raises(ValueError, match="mode"):
        VllmSettings(type="vllm", lora={"mode": "sideways"})


def test_a_version_stays_while_newest_or_while_a_request_runs_on_it(tmp_path):
    """versions_resident 2: after v1..v4 the newest two stay, an older one only while a request is pinned to it; vLLM
    ids are never reused; a removed version's folder is gone."""
    name = "model.layers.0.mlp.down_proj"
    adapters = {name + ".lora_A.weight": torch.ones(2, 8), name + ".lora_B.weight": torch.ones(8, 2)}
    versions = AdapterVersions(2, root=tmp_path)
    ids = [versions.add(v, adapters, 16)[0] for v in (1, 2, 3, 4)]
    assert ids == [1, 2, 3, 4]
    assert versions.leaving(in_use={2}) == [1]
    folder = versions.resident[1][1]
    assert versions.remove(1) == 1 and not folder.exists()
    assert versions.leaving(in_use={2}) == [] and versions.leaving(in_use=set()) == [2]
    versions.remove(2)
    assert versions.add(5, adapters, 16)[0] == 5 and versions.leaving(set()) == [3]
    with pytest.raises(ValueError, match="resident already"):
        versions.add(5, adapters, 16)


def test_unmerged_mode_turns_on_the_engines_lora_with_one_slot_more_than_versions_resident():
    """vLLM's EngineArgs and SGLang's ServerArgs of lora.mode unmerged; merged adds none (no LoRA layers)."""
    from rollout.engines.settings import SglangSettings
    from rollout.engines.sglang_weights import lora_server_args
    from rollout.engines.vllm_engine import engine_args

    lora = {"mode": "unmerged", "versions_resident": 3, "max_rank": 32}
    args = engine_args("m", VllmSettings(type="vllm", lora=lora))
    assert (args["enable_lora"], args["max_lora_rank"], args["max_loras"], args["max_cpu_loras"]) == (True, 32, 4, 8)
    assert "enable_lora" not in engine_args("m", VllmSettings(type="vllm"))
    sglang = lora_server_args(SglangSettings(type="sglang", lora=lora))
    assert (sglang["enable_lora"], sglang["max_lora_rank"], sglang["max_loras_per_batch"]) == (True, 32, 4)
    assert lora_server_args(SglangSettings(type="sglang")) == {}
