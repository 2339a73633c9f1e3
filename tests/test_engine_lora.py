"""LoRA served unmerged by the native engine (rollout/model/lora.py, rollout/engine/adapter_pins.py): greedy tokens
equal transformers + peft's for the same adapter; a request finishes on the adapter version it started on; rows of
two versions run in one step, each as its own engine would; the prefix cache misses across versions."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams

torch.set_num_threads(1)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = [1, *range(10, 30)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def peft_model(model_dir, targets: list[str], seed: int):
    """transformers' model of `model_dir` with a random peft LoRA (B not zero, so the adapter matters)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape) * 0.15)
    return model.eval()


def published(model) -> dict[str, torch.Tensor]:
    """The adapters as a LoRA trainer publishes them: Hugging Face module names, B scaled by alpha / r."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            hf = name.removeprefix("base_model.model.")
            out[f"{hf}.lora_A.weight"] = module.lora_A["default"].weight.detach().clone()
            out[f"{hf}.lora_B.weight"] = module.lora_B["default"].weight.detach() * module.scaling["default"]
    return out


def greedy_reference(model, prompt=PROMPT, steps=GREEDY.max_tokens) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def engine_with(model_dir, adapters: dict | None = None, version: int = 1, **config) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=128, dtype="float32", **config))
    if adapters is not None:
        engine.load_weights(adapters, version)
    return engine


def tokens_of(engine: LLMEngine, prompt=PROMPT) -> list[int]:
    return engine.generate([prompt], GREEDY)[0].completions[0].token_ids


@pytest.fixture(scope="module")
def adapters(sharp_model_dir):
    """Two adapter versions (all linear layers), and their peft models."""
    models = [peft_model(sharp_model_dir, ALL, seed) for seed in (1, 2)]
    return [published(model) for model in models], models


@pytest.mark.parametrize("targets", [ALL, ["q_proj", "v_proj", "down_proj"]], ids=["all-linear", "some-parts"])
def test_unmerged_greedy_tokens_equal_transformers_and_peft(sharp_model_dir, targets):
    model = peft_model(sharp_model_dir, targets, seed=3)
    engine = engine_with(sharp_model_dir, published(model))
    want = greedy_reference(model)
    with model.disable_adapter():
        base = greedy_reference(model)
    assert want != base  # the adapter changes what is generated
    assert tokens_of(engine) == want
    assert engine.stats["lora_versions_resident"] == 1
    # the adapted forward stays on the engine's path: the fused q/k/v and gate/up matmuls, W untouched
    assert engine.runner.adapters.versions[1].keys() >= {"model.layers.0.mlp.down_proj"}


def test_a_request_finishes_on_the_version_it_started_on(sharp_model_dir, adapters):
    (first, second), _ = adapters
    engine = engine_with(sharp_model_dir, first, version=1)
    weight = engine.runner.model.model.layers[0].self_attn.qkv_weight.clone()
    engine.add_request("pinned", PROMPT, GREEDY)
    early = [out for _ in range(4) for out in engine.step()]
    engine.load_weights(second, version=2)
    assert torch.equal(engine.runner.model.model.layers[0].self_attn.qkv_weight, weight)  # W untouched
    engine.add_request("new", PROMPT, GREEDY)
    late = []
    while engine.has_unfinished_requests():
        late += engine.step()
    pinned = [out for out in early + late if out.request_id == "pinned"]
    new = [out for out in late if out.request_id == "new"]
    assert [out.token_id for out in pinned] == tokens_of(engine_with(sharp_model_dir, first, version=1))
    assert {out.weight_version for out in pinned} == {1} and pinned[-1].kv_version == 1
    assert [out.token_id for out in new] == tokens_of(engine_with(sharp_model_dir, second, version=2))
    assert {out.weight_version for out in new} == {2}
    assert tokens_of(engine_with(sharp_model_dir, first)) != tokens_of(engine_with(sharp_model_dir, second))


def test_the_completions_of_a_request_mid_prefill_stay_on_its_version(sharp_model_dir, adapters):
    (first, second), _ = adapters
    chunked = {"max_num_batched_tokens": 8, "max_num_seqs": 8, "max_n": 2}  # the prompt's prefill takes three steps
    engine = engine_with(sharp_model_dir, first, version=1, **chunked)
    two = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True, n=2)
    engine.add_request("pair", PROMPT, two)
    outputs = engine.step()  # completion 0 prefilling, completion 1 waiting to fork it
    engine.load_weights(second, version=2)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    want = tokens_of(engine_with(sharp_model_dir, first, **chunked))
    for index in (0, 1):
        assert [out.token_id for out in outputs if out.index == index] == want, index
    assert {out.weight_version for out in outputs} == {1}


def test_a_session_turn_finishes_on_its_version_and_the_next_turn_takes_the_newest(sharp_model_dir, adapters):
    (first, second), _ = adapters
    engine = engine_with(sharp_model_dir, first, version=1)
    engine.open_session("s", PROMPT)
    engine.add_session_request("turn1", "s", GREEDY)
    outputs = [out for _ in range(3) for out in engine.step()]
    engine.load_weights(second, version=2)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [out.token_id for out in outputs] == tokens_of(engine_with(sharp_model_dir, first))
    assert {out.weight_version for out in outputs} == {1}
    engine.append_to_session("s", [5, 6, 7])
    engine.add_session_request("turn2", "s", GREEDY)
    second_turn = []
    while engine.has_unfinished_requests():
        second_turn += engine.step()
    assert {out.weight_version for out in second_turn} == {2} and second_turn[-1].kv_version == 1  # its context: v1
    record = engine.close_session("s")
    assert record.weight_versions[-GREEDY.max_tokens:] == [2] * GREEDY.max_tokens


def test_recompute_moves_a_request_to_the_newest_version(sharp_model_dir, adapters):
    (first, second), _ = adapters
    engine = engine_with(sharp_model_dir, first, version=1, kv_on_update="recompute")
    engine.add_request("moved", PROMPT, GREEDY)
    early = [out for _ in range(3) for out in engine.step()]
    engine.load_weights(second, version=2)
    late = []
    while engine.has_unfinished_requests():
        late += engine.step()
    assert {out.weight_version for out in early} == {1} and {out.weight_version for out in late} == {2}
    assert late[-1].kv_version == 2 and engine.stats["policy_version_moves"] == 1


def test_rows_of_two_versions_share_a_step_and_each_equals_its_own_engine(sharp_model_dir, adapters):
    (first, second), _ = adapters
    engine = engine_with(sharp_model_dir, first, version=1)
    other = [1, *range(40, 52)]
    engine.add_request("v1", PROMPT, GREEDY)
    outputs = engine.step()
    engine.load_weights(second, version=2)
    engine.add_request("v2", other, GREEDY)
    mixed_steps = 0
    while engine.has_unfinished_requests():
        step = engine.step()
        outputs += step
        mixed_steps += {out.weight_version for out in step} == {1, 2}
    assert mixed_steps >= GREEDY.max_tokens - 2  # the two versions decode together
    assert [o.token_id for o in outputs if o.request_id == "v1"] == tokens_of(engine_with(sharp_model_dir, first))
    assert [o.token_id for o in outputs if o.request_id == "v2"] == tokens_of(engine_with(sharp_model_dir, second),
                                                                              other)


def test_the_prefix_cache_misses_across_versions(sharp_model_dir, adapters):
    (first, second), _ = adapters
    engine = engine_with(sharp_model_dir, first, version=1, block_size=4)
    tokens_of(engine)
    hits = engine.stats["prefix_cache_hit_tokens"]
    assert tokens_of(engine) == tokens_of(engine_with(sharp_model_dir, first)) and \
        engine.stats["prefix_cache_hit_tokens"] > hits  # the same version: a hit
    engine.load_weights(second, version=2)
    hits = engine.stats["prefix_cache_hit_tokens"]
    assert tokens_of(engine) == tokens_of(engine_with(sharp_model_dir, second, version=2))
    assert engine.stats["prefix_cache_hit_tokens"] == hits  # another adapter: a miss, although version 1's is cached
    tokens_of(engine)
    assert engine.stats["prefix_cache_hit_tokens"] > hits


def test_a_version_that_leaves_moves_its_sequences_to_the_newest(sharp_model_dir, adapters):
    (first, second), _ = adapters
    engine = engine_with(sharp_model_dir, first, version=1, lora={"versions_resident": 2})
    engine.add_request("old", PROMPT, GREEDY)
    engine.step()
    engine.load_weights(second, version=2)
    engine.step()
    engine.load_weights(first, version=3)  # version 1 leaves
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert sorted(engine.runner.adapters.versions) == [2, 3]
    assert {out.weight_version for out in outputs} == {3} and engine.stats["policy_version_moves"] == 1


def test_merged_mode_and_unadaptable_weights_are_refused(sharp_model_dir, adapters):
    (first, _), _ = adapters
    merged = engine_with(sharp_model_dir, lora={"mode": "merged"})
    assert not merged.serves_adapters_unmerged
    with pytest.raises(ValueError, match="merged"):
        merged.load_weights(first, 1)
    engine = engine_with(sharp_model_dir)
    assert "not a projection" in engine.adapter_problem("lm_head.weight")
    with pytest.raises(ValueError, match="lm_head"):
        engine.load_weights({"lm_head.lora_A.weight": torch.zeros(2, 128),
                             "lm_head.lora_B.weight": torch.zeros(101, 2)}, 1)
    with pytest.raises(ValueError, match="versions_resident"):
        EngineConfig(model=str(sharp_model_dir), lora={"versions_resident": 0})
