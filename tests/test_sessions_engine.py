"""Sessions in the native engine: token in, token out over many turns, KV kept between turns (a turn
prefills only its new tokens), logprobs equal a transformers forward pass, KV dropped under memory pressure
and recomputed, expiry, refusals, and no block leaked."""

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import EngineConfig
from rollout.engine.errors import (
    ContextFull,
    DuplicateRequest,
    InvalidRequest,
    QueueFull,
    SessionBusy,
    SessionNotFound,
)
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.sequence import FinishReason


def run_turn(engine: LLMEngine, session_id: str, params: SamplingParams, request_id: str = "turn") -> list[int]:
    engine.add_session_request(request_id, session_id, params)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [out.token_id for out in engine.step() if out.token_id is not None and out.request_id == request_id]
    return tokens


def observation(turn: int) -> list[int]:
    return [10 + (turn * 7 + i) % 80 for i in range(3 + turn % 4)]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def reference_logprobs(hf_model, tokens: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of every token given the ones before it, one forward pass."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([tokens])).logits[0].float() / temperature
    logprobs = torch.log_softmax(logits[:-1], dim=-1)
    return torch.cat([torch.zeros(1), logprobs.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)])


def test_ten_turns_are_token_exact_prefill_only_new_tokens_and_match_a_forward_pass(tiny_model_dir, hf_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=8, num_blocks=128, max_model_len=512))
    prompt = [1, 40, 41, 42, 43, 44, 45]
    engine.open_session("s", prompt)
    expected = list(prompt)
    mask: list[int] = []
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=3)
    for turn in range(10):
        before = engine.step_stats.num_prefill_tokens
        uncached = len(expected) if turn == 0 else 1 + len(observation(turn - 1))  # last sampled token + new
        generated = run_turn(engine, "s", params, f"t{turn}")
        assert engine.step_stats.num_prefill_tokens - before == uncached, f"turn {turn} recomputed cached tokens"
        expected += generated
        mask += [1] * len(generated)
        obs = observation(turn)
        engine.append_to_session("s", obs, turn_reward=0.1 * turn)
        expected += obs
        mask += [0] * len(obs)
    record = engine.close_session("s")
    assert record.prompt_ids + record.response_ids == expected
    assert record.loss_mask == mask and record.turns == 10
    assert record.turn_rewards == pytest.approx([0.1 * t for t in range(10)])
    assert record.turn_prefill_tokens[0] == len(prompt) and record.kv_recomputes == 0
    assert record.temperature == pytest.approx(0.8)
    reference = reference_logprobs(hf_model, expected, 0.8)[len(prompt):]
    policy = torch.tensor(mask, dtype=torch.bool)
    got = torch.tensor(record.logprobs)
    assert torch.allclose(got[policy], reference[policy], atol=1e-4)
    assert (got[~policy] == 0).all()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks  # nothing leaked


def test_memory_pressure_drops_idle_session_kv_and_recomputes_it_exactly(tiny_model_dir, hf_model):
    # 12 blocks of 8 tokens: three sessions of ~40 tokens cannot all stay resident.
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=8, num_blocks=12, max_model_len=96))
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=1)
    tokens = {}
    for name in "abc":
        prompt = [1] + [20 + ord(name) % 50 + i for i in range(30)]
        engine.open_session(name, prompt)
        tokens[name] = prompt + run_turn(engine, name, params, f"{name}0")
    assert engine.sessions.num_evictions > 0
    for name in "abc":
        engine.append_to_session(name, [5, 6, 7])
        tokens[name] += [5, 6, 7] + run_turn(engine, name, params, f"{name}1")
    for name in "abc":
        record = engine.close_session(name)
        assert record.prompt_ids + record.response_ids == tokens[name]
        reference = reference_logprobs(hf_model, tokens[name], 1.0)[len(record.prompt_ids):]
        policy = torch.tensor(record.loss_mask, dtype=torch.bool)
        assert torch.allclose(torch.tensor(record.logprobs)[policy], reference[policy], atol=1e-4)
    assert engine.block_manager.num_free_blocks == 12


def test_a_plain_request_takes_blocks_from_idle_sessions(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=8, num_blocks=12, max_model_len=96))
    engine.open_session("idle", [1] + [30] * 60)
    run_turn(engine, "idle", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert engine.sessions.num_blocks_held >= 8
    [out] = engine.generate([[1] + [31] * 60], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(out.completions[0].token_ids) == 20
    assert engine.sessions.num_evictions == 1
    run_turn(engine, "idle", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "again")
    assert engine.sessions.sessions["idle"].kv_recomputes == 1


def test_refusals_name_the_problem_and_leave_the_session_usable(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=8, num_blocks=64, max_model_len=64,
                                    max_sessions=2))
    engine.open_session("s", [1, 2, 3])
    with pytest.raises(DuplicateRequest):
        engine.open_session("s", [1])
    engine.open_session("t", [1])
    with pytest.raises(QueueFull, match="max_sessions=2"):
        engine.open_session("u", [1])
    with pytest.raises(SessionNotFound, match="not open"):
        engine.append_to_session("nope", [4])
    with pytest.raises(InvalidRequest, match="token_ids"):
        engine.append_to_session("s", [10_000])
    with pytest.raises(ContextFull):
        engine.append_to_session("s", [4] * 70)
    with pytest.raises(InvalidRequest, match="params.n"):
        engine.add_session_request("r", "s", SamplingParams(n=2))
    engine.add_session_request("r1", "s", SamplingParams(temperature=0.5, max_tokens=3, ignore_eos=True))
    with pytest.raises(SessionBusy):
        engine.add_session_request("r2", "s", SamplingParams(max_tokens=3))
    with pytest.raises(SessionBusy):
        engine.append_to_session("s", [4])
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(InvalidRequest, match="temperature"):
        engine.add_session_request("r3", "s", SamplingParams(temperature=1.0, max_tokens=3))
    # max_tokens is cut to the context left; at the context length the turn is OUT_OF_RANGE.
    engine.append_to_session("s", [4] * (64 - 6 - 2))
    generated = run_turn(engine, "s", SamplingParams(temperature=0.5, max_tokens=50, ignore_eos=True), "r4")
    assert len(generated) == 2 and engine.session_state("s").finish_reason is FinishReason.LENGTH
    with pytest.raises(ContextFull):
        engine.add_session_request("r5", "s", SamplingParams(temperature=0.5))
    record = engine.close_session("s")
    assert len(record.prompt_ids) + len(record.response_ids) == 64


def test_idle_sessions_expire_with_a_clear_message(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64, max_model_len=64,
                                    session_idle_timeout_s=0.2))
    engine.open_session("old", [1, 2])
    run_turn(engine, "old", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    time.sleep(0.3)
    assert engine.expire_sessions() == ["old"]
    with pytest.raises(SessionNotFound, match="expired"):
        engine.append_to_session("old", [3])
    assert engine.block_manager.num_free_blocks == 64


def test_close_during_a_turn_aborts_it_and_keeps_the_partial_turn(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64, max_model_len=128))
    engine.open_session("s", [1, 2, 3])
    engine.add_session_request("r", "s", SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    record = engine.close_session("s")
    assert record.finish_reason is FinishReason.ABORT and len(record.response_ids) == 4
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == 64


def test_a_session_spans_a_weight_update(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64, max_model_len=128))
    engine.open_session("s", [1, 2, 3])
    engine.add_session_request("r", "s", SamplingParams(max_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    weights = {name: p.detach().clone() for name, p in engine.runner.model.named_parameters()}
    engine.load_weights(weights, version=7)
    while engine.has_unfinished_requests():
        engine.step()
    record = engine.close_session("s")
    assert record.weight_versions == [0, 0, 0, 7, 7, 7]
