"""In-place weight loading by name, adopting staged tensors, versions on every token, and the parameter/view layout."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import write_tiny_model
from services.weights import allocate_staging, merge_order, pack_bucket, plan_buckets, unpack_buckets

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


def _staged(weights: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """`weights` as a weight receiver holds them after a broadcast: packed in merge order into staging
    buffers (slices of one allocation); returns the buffers and the named views into them."""
    manifest = plan_buckets(merge_order([(n, tuple(t.shape), t.dtype) for n, t in weights.items()]), bucket_bytes)
    staging = allocate_staging(manifest, torch.device("cpu"))
    for index, buffer in enumerate(staging):
        pack_bucket(manifest, index, weights, out=buffer)
    return staging, unpack_buckets(manifest, staging)


def _inside(tensor: torch.Tensor, staging: list[torch.Tensor]) -> bool:
    start, end = staging[0].data_ptr(), staging[-1].data_ptr() + staging[-1].numel()
    return start <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= end


def _greedy(engine: LLMEngine):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    completion = engine.generate([[5, 6, 7, 8]], params)[0].completions[0]
    return completion.token_ids, completion.logprobs


def test_adopt_serves_the_staged_bytes_without_a_copy_and_lets_go_of_the_old_ones(two_models):
    first, second = two_models
    engine = LLMEngine(EngineConfig(model=str(first), max_model_len=64))
    model = engine.runner.model
    expected = {path: _greedy(LLMEngine(EngineConfig(model=str(path), max_model_len=64))) for path in two_models}

    staging, views = _staged(load_file(second / "model.safetensors"), bucket_bytes=1 << 16)
    engine.load_weights(views, version=2, adopt=True)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    served = [*model.parameters(), attn.qkv_weight, attn.qkv_bias, mlp.gate_up_weight]
    assert all(_inside(t, staging) for t in served)  # q/k/v and gate/up merged in place, nothing copied
    assert attn.k_proj.weight.data_ptr() == attn.qkv_weight[attn.q_proj.weight.shape[0]:].data_ptr()
    assert _greedy(engine) == expected[second] and engine.weight_version == 2

    _, views = _staged(load_file(first / "model.safetensors"), bucket_bytes=1 << 16)
    engine.load_weights(views, version=3, adopt=True)
    assert not any(_inside(t, staging) for t in [*model.parameters(), attn.qkv_weight, mlp.gate_up_weight])
    for buffer in staging:  # the replaced version's memory is the caller's again
        buffer.fill_(0)
    assert _greedy(engine) == expected[first]


def test_adopt_refuses_a_partial_update_and_copies_what_it_cannot_take_as_is(two_models):
    first, second = two_models
    engine = LLMEngine(EngineConfig(model=str(first), max_model_len=64))
    model = engine.runner.model
    before = _greedy(engine)
    update = load_file(second / "model.safetensors")  # one tensor per name: nothing lies back to back
    with pytest.raises(ValueError, match="every parameter"):
        engine.load_weights({k: v for k, v in update.items() if "layers.1.mlp" not in k}, version=1, adopt=True)
    assert engine.weight_version == 0 and _greedy(engine) == before

    engine.load_weights(update, version=1, adopt=True)
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.weight.data_ptr() == update["model.layers.0.self_attn.o_proj.weight"].data_ptr()
    assert attn.qkv_weight.data_ptr() not in {t.data_ptr() for t in update.values()}  # merged by a copy
    assert _greedy(engine) == _greedy(LLMEngine(EngineConfig(model=str(second), max_model_len=64)))
