"""In-place weight loading by name, versions on every token, and the parameter/view layout."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollout.config import EngineConfig
from rollout.engine import LLMEngine
from rollout.sampling_params import SamplingParams
from rollout.tiny import write_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return write_tiny_model(root / "a", seed=1), write_tiny_model(root / "b", seed=2)


def test_parameters_carry_checkpoint_names(two_models):
    engine = LLMEngine(EngineConfig(model=str(two_models[0]), max_model_len=64))
    names = set(dict(engine.runner.model.named_parameters()))
    assert names == set(load_file(two_models[0] / "model.safetensors"))


def test_load_weights_switches_model_and_version(two_models):
    first, second = two_models
    engine = LLMEngine(EngineConfig(model=str(first), max_model_len=128))
    prompt = [7, 8, 9, 10, 11]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    engine.add_request("inflight", prompt, greedy)
    before = [out for _ in range(4) for out in engine.step()]
    engine.load_weights(load_file(second / "model.safetensors"), version=3)
    after = []
    while engine.has_unfinished_requests():
        after += engine.step()
    assert [o.weight_version for o in before] == [0] * 4
    assert [o.weight_version for o in after] == [3] * 12  # in-flight sequence continued on the new weights

    hf_second = AutoModelForCausalLM.from_pretrained(second).eval()
    expected = hf_second.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16)
    got = engine.generate([prompt], greedy)[0].completions[0]
    assert got.token_ids == expected[0, len(prompt):].tolist()
    assert got.weight_versions == [3] * 16


def test_bad_update_changes_nothing(two_models):
    first, second = two_models
    engine = LLMEngine(EngineConfig(model=str(first), max_model_len=64))
    snapshot = {k: v.clone() for k, v in engine.runner.model.state_dict().items()}
    update = load_file(second / "model.safetensors")
    with pytest.raises(ValueError, match="not a parameter"):
        engine.load_weights({**update, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="shape"):
        engine.load_weights({**update, "lm_head.weight": torch.zeros(3, 3)}, version=1)
    assert engine.weight_version == 0
    for name, value in engine.runner.model.state_dict().items():
        assert torch.equal(value, snapshot[name]), name


def test_merged_projections_follow_named_parameters(two_models):
    engine = LLMEngine(EngineConfig(model=str(two_models[0]), max_model_len=64))
    attn = engine.runner.model.model.layers[0].self_attn
    engine.load_weights({"model.layers.0.self_attn.k_proj.weight": torch.full_like(attn.k_proj.weight, 0.5)}, version=1)
    q_rows = attn.q_proj.weight.shape[0]
    assert torch.all(attn.qkv_weight[q_rows : q_rows + attn.k_proj.weight.shape[0]] == 0.5)
