"""Routing replay (R3) in the native engine: a mixture-of-experts completion carries the experts each token was
routed to, equal to transformers' routers over the same tokens, through chunked prefill, preemption, forks, the
prefix cache and a session's turns; KV kept across a weight update keeps the routes it was computed with."""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import write_tiny_model
from trainer.moe.routing import RouterHooks

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):  # 3 layers, the middle one dense: routes of 2 sparse layers, top 2 of 4
    return write_tiny_model(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe", seed=5, num_layers=3,
                            mlp_only_layers=(1,))


@pytest.fixture(scope="module")
def hf_moe(moe_dir):
    return AutoModelForCausalLM.from_pretrained(moe_dir).eval()


def make_engine(model_dir, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), **{"block_size": 4, "max_model_len": 64, **overrides}))


def hf_routes(hf_model, tokens: list[int]) -> np.ndarray:
    """transformers' routes of every token, [tokens, sparse layers, top_k], each token's experts sorted."""
    hooks = RouterHooks(hf_model)
    with torch.no_grad():
        hf_model(torch.tensor([tokens]))
    return np.sort(torch.stack(hooks.own, dim=1).numpy(), axis=-1)


def assert_routes(routes, hf_model, tokens: list[int]) -> None:
    assert routes is not None and routes.dtype == np.uint8
    assert routes.shape == (len(tokens) - 1, 2, 2)  # every token but the last sampled one
    assert (np.sort(routes, axis=-1) == hf_routes(hf_model, tokens[:-1])).all()


def test_completions_carry_transformers_routes_through_chunks_preemption_and_forks(moe_dir, hf_moe):
    # 6 tokens a step: prompts are prefilled in chunks; 10 blocks cannot hold them all: one is preempted
    engine = make_engine(moe_dir, num_blocks=10, max_model_len=40, max_num_batched_tokens=6, max_num_seqs=4, max_n=2)
    prompts = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [1] + list(range(40, 52)), [1, 70, 71]]
    outputs = engine.generate(prompts, [GREEDY, GREEDY, SamplingParams(temperature=1.0, n=2, max_tokens=6, seed=3)])
    assert engine.stats["preemptions"] > 0
    for prompt, out in zip(prompts, outputs):
        for completion in out.completions:  # the forks of n=2 take their sibling's prompt routes
            assert_routes(completion.routed_experts, hf_moe, prompt + completion.token_ids)


def test_prefix_cache_hits_carry_the_routes_of_the_cached_blocks(moe_dir, hf_moe):
    engine = make_engine(moe_dir)
    base = [1] + list(range(20, 33))  # 14 tokens: 3 full blocks shared
    first = engine.generate([base + [60]], GREEDY)[0].completions[0]
    second = engine.generate([base + [61, 62]], GREEDY)[0].completions[0]
    assert engine.stats["prefix_cache_hit_tokens"] == 12
    assert_routes(first.routed_experts, hf_moe, base + [60] + first.token_ids)
    assert_routes(second.routed_experts, hf_moe, base + [61, 62] + second.token_ids)


def test_a_session_keeps_its_routes_across_turns_and_a_weight_update(moe_dir, hf_moe, tmp_path):
    engine = make_engine(moe_dir, kv_on_update="keep")
    prompt = [1, 40, 41, 42, 43, 44, 45]
    engine.open_session("s", prompt)
    engine.add_session_request("t0", "s", GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    engine.append_to_session("s", [50, 51, 52])
    context = len(engine.sessions.sessions["s"].token_ids)
    # new weights: the session's KV (and so its routes) stay those of the old weights
    other = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "new", arch="qwen3_moe", seed=9,
                                                                  num_layers=3, mlp_only_layers=(1,))).eval()
    engine.load_weights(dict(other.state_dict()), version=1)
    before = engine.step_stats.num_prefill_tokens
    engine.add_session_request("t1", "s", GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.step_stats.num_prefill_tokens - before == 1 + 3  # the turn reused the kept KV
    record = engine.close_session("s")
    tokens = record.prompt_ids + record.response_ids
    routes = np.sort(record.routed_experts, axis=-1)
    assert routes.shape == (len(tokens) - 1, 2, 2)
    kept = context - 4  # tokens whose KV was computed before the update
    assert (routes[:kept] == hf_routes(hf_moe, tokens[:kept])).all()


def test_a_dense_model_reports_no_routes(tmp_path):
    engine = make_engine(write_tiny_model(tmp_path / "d", arch="qwen3"))
    assert engine.generate([[1, 5, 6]], GREEDY)[0].completions[0].routed_experts is None


def test_a_re_run_chunk_cut_by_the_router_keeps_its_routes():
    from protos import rollout_pb2
    from protos.codec import decode_tensor, encode_array, encode_tensor
    from protos.sample import ROUTE_DTYPES
    from rollout.router.service import _tail

    routes = np.arange(5 * 2 * 2, dtype=np.uint8).reshape(5, 2, 2)
    chunk = rollout_pb2.GenerateChunk(request_id="r", index=0, token_ids=encode_array([5, 6, 7], "int32"),
                                      weight_versions=encode_array([2, 2, 3], "int64"),
                                      finish_reason=rollout_pb2.FINISH_REASON_STOP,
                                      routed_experts=encode_tensor(routes, "uint8"))
    cut = decode_tensor(_tail(chunk, 2).routed_experts, "routed_experts", ROUTE_DTYPES, 3)
    assert (cut == routes).all()  # the routes cover the whole context: the cut keeps them all
