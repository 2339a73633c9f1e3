"""The native engine serves a mixture-of-experts model (qwen3_moe) as transformers computes it: greedy tokens equal,
logprobs within 1e-5 (float32), from either weight-name form, after weight updates, and through the paged KV cache,
the prefix cache, chunked prefill and sessions; the registry refuses an unknown model type by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from rollout.config import SUPPORTED_MODEL_TYPES, EngineConfig, ModelConfig, MoeConfig, choose_cuda_graphs
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.model.registry import MODEL_CLASSES, model_class
from rollout.model.tiny import write_tiny_model
from rollout.serve.weight_receiver import check_layout
from services.weights import allocate_staging, merge_order, pack_bucket, plan_buckets, unpack_buckets

torch.set_num_threads(1)

# 3 layers, the middle one dense (mlp_only_layers): both kinds of layer in one model; 4 experts, top 2.
MOE = {"arch": "qwen3_moe", "num_layers": 3, "mlp_only_layers": (1,)}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[1, 5, 6, 7, 8, 9, 10], [1] + list(range(40, 58)), [1, 70, 71]]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("moe") / "m", seed=11, **MOE)


@pytest.fixture(scope="module")
def hf_moe(moe_dir):
    return AutoModelForCausalLM.from_pretrained(moe_dir).eval()


def make_engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"block_size": 4, "max_model_len": 96, **overrides}))


def reference(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token_t | prefix) from one transformers forward pass over prompt + tokens."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def assert_matches_transformers(engine: LLMEngine, hf_model, prompts=PROMPTS, params=GREEDY) -> float:
    """Greedy tokens equal transformers' generate, logprobs within 1e-5 of its forward; the largest difference."""
    worst = 0.0
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        got = out.completions[0]
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=params.max_tokens,
                                     min_new_tokens=params.max_tokens, do_sample=False)[0, len(prompt):]
        assert got.token_ids == expected.tolist()
        difference = (torch.tensor(got.logprobs) - reference(hf_model, prompt, got.token_ids)).abs().max().item()
        assert difference <= 1e-5
        worst = max(worst, difference)
    return worst


def test_greedy_and_logprobs_match_transformers_with_preemption(moe_dir, hf_moe):
    # 12 blocks of 4 tokens cannot hold the three sequences (2 + 8 + 4 blocks) at once: preemption recomputes one.
    engine = make_engine(moe_dir, num_blocks=12, max_model_len=48)
    assert type(engine.runner.model).__name__ == "Qwen3MoeForCausalLM"
    assert assert_matches_transformers(engine, hf_moe) <= 1e-5
    assert engine.stats["preemptions"] > 0


def test_an_unnormalised_router_and_sparse_steps_match_transformers(tmp_path):
    # norm_topk_prob off, every second layer sparse (decoder_sparse_step 2), top 1 of 4
    folder = write_tiny_model(tmp_path / "m", arch="qwen3_moe", seed=3, num_layers=2, num_experts_per_tok=1,
                              norm_topk_prob=False, decoder_sparse_step=2)
    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert [type(layer.mlp).__name__ for layer in hf_model.model.layers] == ["Qwen3MoeMLP", "Qwen3MoeSparseMoeBlock"]
    assert_matches_transformers(make_engine(folder), hf_model, PROMPTS[:2])


def test_the_fused_and_the_per_expert_names_load_to_the_same_outputs(moe_dir, hf_moe, tmp_path):
    # transformers' save_pretrained writes per-expert names (as Hub checkpoints have); its state dict (what the
    # trainer publishes) holds the fused gate_up_proj / down_proj: a checkpoint in that form serves the same.
    fused = tmp_path / "fused"
    shutil.copytree(moe_dir, fused)
    (fused / "model.safetensors").unlink()
    state = {name: tensor.contiguous() for name, tensor in hf_moe.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    per_expert, merged = make_engine(moe_dir), make_engine(fused)
    assert {name for name, _ in per_expert.runner.model.named_parameters()} == set(state)
    for a, b in zip(per_expert.generate(PROMPTS, GREEDY), merged.generate(PROMPTS, GREEDY), strict=True):
        assert a.completions[0].token_ids == b.completions[0].token_ids
        assert a.completions[0].logprobs == b.completions[0].logprobs


@pytest.mark.parametrize("form", ["fused", "per_expert", "fused_adopted"])
def test_a_weight_update_serves_what_transformers_computes_with_the_new_weights(moe_dir, tmp_path, form):
    other = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "other", seed=5, **MOE)).eval()
    state = {name: tensor.clone() for name, tensor in other.state_dict().items()}
    if form == "per_expert":  # a checkpoint's names: each expert's three matrices
        for layer in (0, 2):
            prefix = f"model.layers.{layer}.mlp.experts"
            gate_up, down = state.pop(f"{prefix}.gate_up_proj"), state.pop(f"{prefix}.down_proj")
            for expert in range(gate_up.shape[0]):
                gate, up = gate_up[expert].chunk(2)
                state |= {f"{prefix}.{expert}.gate_proj.weight": gate, f"{prefix}.{expert}.up_proj.weight": up,
                          f"{prefix}.{expert}.down_proj.weight": down[expert]}
    engine = make_engine(moe_dir)
    engine.generate(PROMPTS, GREEDY)  # served with the old weights first (and their prefixes cached)
    if form == "fused_adopted":  # as the weight receiver does: the manifest checked, the staged bytes served
        manifest = plan_buckets(merge_order([(n, tuple(t.shape), t.dtype) for n, t in state.items()]), 1 << 16)
        check_layout(manifest, engine.parameter_layout())
        staging = allocate_staging(manifest, torch.device("cpu"))
        for index, buffer in enumerate(staging):
            pack_bucket(manifest, index, state, out=buffer)
        state = unpack_buckets(manifest, staging)
    engine.load_weights(state, version=1, adopt=form == "fused_adopted")
    if form == "fused_adopted":
        experts = engine.runner.model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.data_ptr() == state["model.layers.0.mlp.experts.gate_up_proj"].data_ptr()
    assert engine.weight_version == 1
    assert_matches_transformers(engine, other)


def test_an_adopted_update_missing_an_expert_changes_nothing(moe_dir, hf_moe):
    engine = make_engine(moe_dir, enable_prefix_caching=False)  # the same computation twice: equal to the bit
    before = engine.generate(PROMPTS[:1], GREEDY)[0].completions[0].logprobs
    state = {name: tensor.clone() * 2 for name, tensor in hf_moe.state_dict().items()}
    gate_up = state.pop("model.layers.0.mlp.experts.gate_up_proj")
    state |= {f"model.layers.0.mlp.experts.{e}.gate_proj.weight": gate_up[e].chunk(2)[0] for e in range(3)}
    with pytest.raises(ValueError, match="gate_up_proj"):
        engine.runner.model.adopt_weights(state.items())
    with pytest.raises(ValueError, match="experts.4.gate_proj"):  # the model has 4 experts: 0..3
        engine.load_weights({"model.layers.0.mlp.experts.4.gate_proj.weight": gate_up[0].chunk(2)[0]}, version=1)
    assert engine.generate(PROMPTS[:1], GREEDY)[0].completions[0].logprobs == before


def test_prefix_cache_and_chunked_prefill_serve_what_transformers_computes(moe_dir, hf_moe):
    base = [1] + list(range(20, 41))  # 22 tokens: 5 full blocks shared by every prompt
    prompts = [base + [60, 61], base + [70, 71, 72], base + [80]]
    # 8 tokens a step: every prompt is prefilled in chunks, beside the others' decodes
    engine = make_engine(moe_dir, max_num_batched_tokens=8, max_num_seqs=4, max_n=4)
    assert_matches_transformers(engine, hf_moe, prompts[:1])
    assert_matches_transformers(engine, hf_moe, prompts[1:])
    assert engine.stats["prefix_cache_hit_tokens"] == 40
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_sessions_second_turn_prefills_only_its_new_tokens_and_matches_transformers(moe_dir, hf_moe):
    engine = make_engine(moe_dir, num_blocks=64)
    prompt = [1, 40, 41, 42, 43, 44, 45]
    engine.open_session("s", prompt)
    for turn in range(2):
        before = engine.step_stats.num_prefill_tokens
        engine.add_session_request(f"t{turn}", "s", GREEDY)
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.step_stats.num_prefill_tokens - before == (len(prompt) if turn == 0 else 1 + 3)
        engine.append_to_session("s", [50 + turn, 51, 52])
    record = engine.close_session("s")
    tokens = record.prompt_ids + record.response_ids
    mask = torch.tensor(record.loss_mask, dtype=torch.bool)
    expected = reference(hf_moe, prompt, tokens[len(prompt):])
    assert (torch.tensor(record.logprobs)[mask] - expected[mask]).abs().max() <= 1e-5


def test_the_registry_serves_every_supported_type_and_names_them_when_refusing(moe_dir, tmp_path):
    assert set(MODEL_CLASSES) == set(SUPPORTED_MODEL_TYPES)
    raw = json.loads((moe_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "mixtral"}))
    with pytest.raises(ValueError, match="'mixtral' is not supported.*qwen3_moe"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'mixtral' is not supported.*llama"):
        model_class("mixtral")


def test_the_moe_fields_follow_transformers_config():
    # transformers 5.25 saves num_experts as num_local_experts; absent fields take Qwen3MoeConfig's defaults
    moe = MoeConfig.from_raw({"num_local_experts": 8, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (8, 8, 768,
                                                                                                         False)
    assert [moe.is_sparse(layer) for layer in range(6)] == [False, True, False, False, False, True]
    assert not MoeConfig.from_raw({"num_experts": 0}).is_sparse(0)
    with pytest.raises(ValueError, match="mixture-of-experts"):  # experts grouped on the host: no graph replay
        choose_cuda_graphs(True, torch.device("cuda"), "triton", "auto", moe=True)
