"""KV across a weight update in the native engine (engine.kv_on_update): with keep, a session's next turn and a
sequence in flight go on over the KV of the old weights, and their kv_version is the old version; with recompute,
that KV is dropped and recomputed with the new weights before the next token, so they equal a fresh engine's with
the new weights and their kv_version is the new one. References: transformers forward passes (keep: the old
model's KV of the context, the new model over the rest) and a fresh engine loaded with the new weights."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.outputs import TokenOutput
from rollout.engine.sampling_params import SamplingParams

torch.set_num_threads(1)
PROMPT = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]
OBSERVATION = [60, 61, 62, 63, 64]
TEMPERATURE = 0.8
TURN = SamplingParams(temperature=TEMPERATURE, max_tokens=10, seed=5, ignore_eos=True)
INFLIGHT = SamplingParams(temperature=TEMPERATURE, max_tokens=16, seed=9, ignore_eos=True)
BEFORE_UPDATE = 4  # tokens an in-flight sequence samples with the old weights


@pytest.fixture(scope="module")
def new_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model after a training step: every tensor moved (the KV projections too)."""
    out = tmp_path_factory.mktemp("kv-update") / "qwen2"
    shutil.copytree(tiny_model_dir, out)
    gen = torch.Generator().manual_seed(7)
    weights = {name: t + torch.randn(t.shape, generator=gen) * 0.05
               for name, t in load_file(tiny_model_dir / "model.safetensors").items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def new_weights(new_model_dir):
    return load_file(new_model_dir / "model.safetensors")


@pytest.fixture(scope="module")
def hf_models(tiny_model_dir, new_model_dir):
    return tuple(AutoModelForCausalLM.from_pretrained(path).eval() for path in (tiny_model_dir, new_model_dir))


def make_engine(model_dir, kv_on_update: str = "keep", **settings) -> LLMEngine:
    settings = {"block_size": 8, "num_blocks": 64, "max_model_len": 256, **settings}
    return LLMEngine(EngineConfig(model=str(model_dir), kv_on_update=kv_on_update, **settings))


def run(engine: LLMEngine, request_id: str) -> list[TokenOutput]:
    """Step until `request_id` has finished; its outputs."""
    outputs = []
    while request_id in engine.requests:
        outputs += [out for out in engine.step() if out.request_id == request_id]
    return outputs


def turn(engine: LLMEngine, session_id: str, request_id: str) -> list[TokenOutput]:
    engine.add_session_request(request_id, session_id, TURN)
    return run(engine, request_id)


def mixed_logprobs(first, second, tokens: list[int], split: int) -> torch.Tensor:
    """log softmax(logits / T) of each token given those before it, the KV of tokens[:split] computed by `first`
    and the rest by `second` attending to it (first == second: one model's forward pass). Entry 0 is 0."""
    with torch.no_grad():
        head = first(torch.tensor([tokens[:split]]), use_cache=True)
        tail = second(torch.tensor([tokens[split:]]), cache=head.past_key_values)
        logits = torch.cat([head.logits[0], tail.logits[0]]).float() / TEMPERATURE
    logprobs = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), logprobs])


def tokens_of(outputs: list[TokenOutput]) -> list[int]:
    return [out.token_id for out in outputs if out.token_id is not None]


def logprobs_of(outputs: list[TokenOutput]) -> torch.Tensor:
    return torch.tensor([out.logprob for out in outputs if out.token_id is not None])


def session_across_update(engine: LLMEngine, new_weights) -> tuple[list[TokenOutput], list[TokenOutput]]:
    engine.open_session("s", PROMPT)
    first = turn(engine, "s", "t1")
    engine.append_to_session("s", OBSERVATION)
    engine.load_weights(new_weights, version=1)
    return first, turn(engine, "s", "t2")


def test_keep_a_session_turn_after_an_update_is_computed_on_the_old_kv_and_says_so(tiny_model_dir, new_weights,
                                                                                  hf_models):
    engine = make_engine(tiny_model_dir, "keep")
    first, second = session_across_update(engine, new_weights)
    assert first[-1].kv_version == 0
    assert {out.weight_version for out in second} == {1}
    assert second[-1].kv_version == 0  # its context's KV is the first turn's, of version 0
    record = engine.close_session("s")
    assert record.kv_version == 0 and record.kv_recomputes == 0
    assert record.turn_prefill_tokens[1] == 1 + len(OBSERVATION)  # only the new tokens were computed

    context = PROMPT + tokens_of(first) + OBSERVATION + tokens_of(second)
    start = len(context) - len(second)
    cached = len(PROMPT) + len(first) - 1  # the first turn's last token was sampled, never fed
    on_old_kv = mixed_logprobs(*hf_models, context, cached)[start:]
    torch.testing.assert_close(logprobs_of(second), on_old_kv, atol=1e-5, rtol=0)
    fresh = mixed_logprobs(hf_models[1], hf_models[1], context, cached)[start:]
    assert (logprobs_of(second) - fresh).abs().max() > 1e-3  # the old KV made a difference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_recompute_a_session_turn_after_an_update_equals_a_fresh_engine_with_the_new_weights(
        tiny_model_dir, new_model_dir, new_weights):
    engine = make_engine(tiny_model_dir, "recompute")
    first, second = session_across_update(engine, new_weights)
    assert first[-1].kv_version == 0
    assert {out.weight_version for out in second} == {1} and second[-1].kv_version == 1
    record = engine.close_session("s")
    assert record.kv_version == 1 and record.kv_recomputes == 1
    context = PROMPT + tokens_of(first) + OBSERVATION
    assert record.turn_prefill_tokens[1] == len(context)  # the whole context, recomputed

    fresh = make_engine(new_model_dir)
    fresh.open_session("s", context)
    expected = turn(fresh, "s", "t1")
    assert tokens_of(second) == tokens_of(expected)
    torch.testing.assert_close(logprobs_of(second), logprobs_of(expected), atol=1e-5, rtol=0)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def in_flight_across_update(engine: LLMEngine, new_weights) -> list[TokenOutput]:
    engine.add_request("r", PROMPT, INFLIGHT)
    outputs = []
    while len(outputs) < BEFORE_UPDATE:
        outputs += engine.step()
    engine.load_weights(new_weights, version=1)
    outputs += run(engine, "r")
    assert [out.weight_version for out in outputs] == [0] * BEFORE_UPDATE + [1] * (INFLIGHT.max_tokens - BEFORE_UPDATE)
    return outputs


def test_keep_a_sequence_in_flight_goes_on_over_its_old_kv(tiny_model_dir, new_weights, hf_models):
    engine = make_engine(tiny_model_dir, "keep")
    outputs = in_flight_across_update(engine, new_weights)
    assert outputs[-1].kv_version == 0 and engine.scheduler.num_preemptions == 0
    tokens = PROMPT + tokens_of(outputs)
    cached = len(PROMPT) + BEFORE_UPDATE - 1
    expected = torch.cat([mixed_logprobs(hf_models[0], hf_models[0], tokens, cached)[len(PROMPT):cached + 1],
                          mixed_logprobs(*hf_models, tokens, cached)[cached + 1:]])
    torch.testing.assert_close(logprobs_of(outputs), expected, atol=1e-5, rtol=0)


def test_recompute_a_sequence_in_flight_continues_as_the_new_weights_would_from_its_tokens(
        tiny_model_dir, new_model_dir, new_weights):
    engine = make_engine(tiny_model_dir, "recompute")
    outputs = in_flight_across_update(engine, new_weights)
    assert outputs[-1].kv_version == 1 and engine.scheduler.num_preemptions == 1
    so_far = tokens_of(outputs)[:BEFORE_UPDATE]
    rest = INFLIGHT.max_tokens - BEFORE_UPDATE
    fresh = make_engine(new_model_dir)
    fresh.add_request("r", PROMPT + so_far, SamplingParams(temperature=TEMPERATURE, max_tokens=rest, seed=9,
                                                           ignore_eos=True))
    expected = run(fresh, "r")
    assert tokens_of(outputs)[BEFORE_UPDATE:] == tokens_of(expected)
    torch.testing.assert_close(logprobs_of(outputs)[BEFORE_UPDATE:], logprobs_of(expected), atol=1e-5, rtol=0)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_every_kind_of_sequence_across_an_update_reports_its_kv_version(tiny_model_dir, new_weights, mode):
    """Decoding, halfway through a chunked prefill, n > 1 forks, a waiting session turn that brings its KV, and a
    request not started yet: keep leaves the KV of those that hold some at version 0; recompute recomputes them."""
    engine = make_engine(tiny_model_dir, mode, max_num_seqs=8, max_n=2, max_num_batched_tokens=16, num_blocks=96)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("decoding", PROMPT, SamplingParams(temperature=1.0, max_tokens=40, n=2, seed=1, ignore_eos=True))
    engine.open_session("s", PROMPT[:5])
    turn(engine, "s", "t1")
    engine.append_to_session("s", OBSERVATION)
    engine.step()
    engine.add_request("prefilling", [1, *range(10, 50)], greedy)
    engine.step()  # 16 tokens this step: the 2 decodes and 14 of its 40
    assert engine.requests["prefilling"][0].prefilling
    engine.add_request("waiting", PROMPT, greedy)  # neither started at the update
    engine.add_session_request("turn", "s", TURN)
    engine.load_weights(new_weights, version=1)
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finish_reason is not None:
                finals[(out.request_id, out.index)] = out.kv_version
    held = 0 if mode == "keep" else 1
    assert finals == {("decoding", 0): held, ("decoding", 1): held, ("prefilling", 0): held, ("turn", 0): held,
                      ("waiting", 0): 1}
    assert engine.close_session("s").kv_version == held
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
