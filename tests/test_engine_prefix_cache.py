"""Prefix caching across requests: the same greedy tokens and logprobs (within 1e-5) as the engine without
it, for prompts sharing prefixes, GRPO groups and a chat resending its history; hit counts derived block by
block; sessions share cached blocks; a weight update makes cached prompts miss; cached blocks nobody holds
are evicted least recently used."""

import pytest
import torch
from safetensors.torch import load_file

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import write_tiny_model

torch.set_num_threads(1)

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def make_engine(model_dir, caching: bool, **overrides) -> LLMEngine:
    settings = {"block_size": BLOCK, "max_model_len": 128, "enable_prefix_caching": caching, **overrides}
    return LLMEngine(EngineConfig(model=str(model_dir), **settings))


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[list[int]], list[list[float]], int]:
    """One request to the end: each completion's tokens and logprobs, and the prompt tokens the cache supplied."""
    hits = engine.stats["prefix_cache_hit_tokens"]
    [out] = engine.generate([prompt], params)
    return ([c.token_ids for c in out.completions], [c.logprobs for c in out.completions],
            engine.stats["prefix_cache_hit_tokens"] - hits)


def assert_same(cached: tuple, uncached: tuple) -> None:
    assert cached[0] == uncached[0]
    for got, expected in zip(cached[1], uncached[1]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), atol=1e-5, rtol=0)


def test_prompts_sharing_a_prefix_hit_its_full_blocks_and_match_the_uncached_engine(tiny_model_dir):
    cached, uncached = make_engine(tiny_model_dir, True), make_engine(tiny_model_dir, False)
    base = [1] + list(range(30, 51))  # 22 tokens: 5 full blocks and 2 tokens of a sixth
    # 25, 26, 24 and 21 tokens; the last computes one token only (the runner's decode path).
    prompts = [base + [60, 61, 62], base + [70, 71, 72, 73], base + [80, 81], base[:20] + [90]]
    hits = []
    for prompt in prompts:
        result = run(cached, prompt, GREEDY)
        assert_same(result, run(uncached, prompt, GREEDY))
        hits.append(result[2])
    # The first computes everything; the others find base's 5 full blocks (the sixth holds the first
    # request's own tokens). The third (24 tokens, 6 full blocks) may take at most 5: its last token is computed.
    assert hits == [0, 20, 20, 20]
    assert cached.stats["prefix_cache_queried_tokens"] == 25 + 26 + 24 + 21
    assert cached.stats["prefill_tokens"] == 25 + 6 + 4 + 1
    assert uncached.stats["prefix_cache_queried_tokens"] == uncached.stats["prefix_cache_hit_tokens"] == 0
    assert uncached.stats["prefill_tokens"] == 96
    assert cached.block_manager.num_free_blocks == cached.block_manager.num_blocks


def test_a_chat_resending_its_history_hits_what_the_turn_before_computed(tiny_model_dir):
    cached, uncached = make_engine(tiny_model_dir, True), make_engine(tiny_model_dir, False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    history = [1, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]  # 13 tokens
    user_turns = [[40, 41, 42, 43, 44], [50, 51, 52, 53], [60, 61, 62, 63, 64, 65]]
    hits, expected_hits = [], []
    computed_before = 0  # tokens whose KV the turn before computed: its prompt and all its output but the last
    for user in [[], *user_turns]:
        history += user
        result = run(cached, history, params)
        assert_same(result, run(uncached, history, params))
        hits.append(result[2])
        expected_hits.append(min(computed_before // BLOCK, (len(history) - 1) // BLOCK) * BLOCK)
        computed_before = len(history) + params.max_tokens - 1
        history += result[0][0]
    assert hits == expected_hits == [0, 20, 32, 44]


def test_grpo_groups_hit_the_prompt_of_the_group_before(tiny_model_dir):
    cached, uncached = make_engine(tiny_model_dir, True), make_engine(tiny_model_dir, False)
    prompt = [1] + [5 + (i * 11) % 90 for i in range(29)]  # 30 tokens: 7 full blocks and 2 tokens
    group = SamplingParams(temperature=1.0, max_tokens=10, n=8, seed=7, ignore_eos=True)
    first = run(cached, prompt, group)
    assert_same(first, run(uncached, prompt, group))
    assert first[2] == 0 and len(set(map(tuple, first[0]))) > 1
    again = run(cached, prompt, SamplingParams(temperature=1.0, max_tokens=10, n=8, seed=8, ignore_eos=True))
    assert_same(again, run(uncached, prompt, SamplingParams(temperature=1.0, max_tokens=10, n=8, seed=8,
                                                             ignore_eos=True)))
    assert again[2] == 28  # one lookup for the whole group: its completions share the prompt's blocks

    # The same group as 8 requests of one completion (as separate chat calls send it), all added at once.
    singles = [SamplingParams(temperature=1.0, max_tokens=10, seed=100 + i, ignore_eos=True) for i in range(8)]
    before = cached.stats["prefix_cache_hit_tokens"]
    outputs = cached.generate([prompt] * 8, singles)
    assert cached.stats["prefix_cache_hit_tokens"] - before == 8 * 28
    for out, expected in zip(outputs, uncached.generate([prompt] * 8, singles)):
        assert out.completions[0].token_ids == expected.completions[0].token_ids
        torch.testing.assert_close(torch.tensor(out.completions[0].logprobs),
                                   torch.tensor(expected.completions[0].logprobs), atol=1e-5, rtol=0)
    assert cached.block_manager.num_free_blocks == cached.block_manager.num_blocks


def test_a_weight_update_makes_cached_prompts_miss_and_equals_a_fresh_engine(tiny_model_dir, tmp_path):
    other = write_tiny_model(tmp_path / "other", seed=5)
    engine = make_engine(tiny_model_dir, True)
    prompt = [1] + list(range(40, 61))  # 22 tokens
    assert run(engine, prompt, GREEDY)[2] == 0
    assert run(engine, prompt, GREEDY)[2] == 20
    # A request in flight across the update: its KV (old weights before, mixed after) must never be reused.
    inflight = [1] + list(range(70, 85))  # 16 tokens
    engine.add_request("inflight", inflight, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    generated = [out.token_id for _ in range(3) for out in engine.step()]
    engine.load_weights(load_file(other / "model.safetensors"), version=1)
    while engine.has_unfinished_requests():
        generated += [out.token_id for out in engine.step()]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.block_manager.cached_block_ids and not engine.block_manager.evictable_block_ids

    fresh = make_engine(other, False)
    after = run(engine, prompt, GREEDY)
    assert after[2] == 0
    assert_same(after, run(fresh, prompt, GREEDY))
    resend = inflight + generated + [90, 91]
    result = run(engine, resend, GREEDY)
    assert result[2] == 0
    assert_same(result, run(fresh, resend, GREEDY))
    assert run(engine, prompt, GREEDY)[2] == 20  # the new weights' KV is cached again


def test_cached_blocks_nobody_holds_are_evicted_least_recently_used(tiny_model_dir):
    engine = make_engine(tiny_model_dir, True, num_blocks=16, max_model_len=64)
    reference = make_engine(tiny_model_dir, False, num_blocks=16, max_model_len=64)
    one = SamplingParams(temperature=0.0, max_tokens=1)
    prompts = {name: [1] + [base + i for i in range(12)] for name, base in (("a", 10), ("b", 30), ("c", 50))}
    prompts["d"] = [1] + list(range(60, 89))  # 30 tokens: 8 blocks
    # 13-token prompts: 3 full blocks cached each, their partial block plainly free again.
    order = ["a", "b", "c", "a", "d", "b", "c", "a"]
    hits = []
    for name in order:
        result = run(engine, prompts[name], one)
        assert_same(result, run(reference, prompts[name], one))
        hits.append(result[2])
    # After a, b, c: 9 cached blocks, 7 plainly free; a again refreshes a's blocks (most recently used).
    # d needs 8 fresh blocks: the 7 free ones and the least recently used cached block, b's last.
    # b again finds its first 2 blocks and needs 2 fresh: d's partial block, then c's last (now the oldest).
    # c again finds its first 2 the same way and evicts a's last: a was used before d, and d's are younger.
    assert hits == [0, 0, 0, 12, 0, 8, 8, 8]
    assert engine.block_manager.num_free_blocks == 16
    assert len(engine.block_manager.evictable_block_ids) == len(engine.block_manager.cached_block_ids) > 0


def session_turn(engine: LLMEngine, session_id: str, params: SamplingParams) -> int:
    """Run the session's next turn to the end; the prompt tokens the cache supplied."""
    hits = engine.stats["prefix_cache_hit_tokens"]
    engine.add_session_request(f"{session_id}-{engine.sessions.sessions[session_id].turns}", session_id, params)
    while engine.has_unfinished_requests():
        engine.step()
    return engine.stats["prefix_cache_hit_tokens"] - hits


def test_sessions_share_a_cached_system_prompt_and_an_evicted_session_finds_its_blocks_again(tiny_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    system = [1] + list(range(20, 35))  # 16 tokens: 4 full blocks
    records, hits = {}, {}
    for caching in (True, False):
        engine = make_engine(tiny_model_dir, caching, num_blocks=40, max_model_len=64)
        engine.open_session("a", system + [40, 41])
        engine.open_session("b", system + [50, 51, 52])
        hits[caching] = [session_turn(engine, "a", params), session_turn(engine, "b", params)]
        assert engine.sessions.evict_idle()  # a's blocks (a was used least recently): b still holds the system's
        engine.append_to_session("a", [42, 43])
        hits[caching].append(session_turn(engine, "a", params))
        records[caching] = [engine.close_session(name) for name in "ab"]
        assert engine.block_manager.num_free_blocks == 40
    # b starts on the 4 blocks of the system prompt that a computed; a's second turn (26 tokens) finds the 5 full
    # blocks its first turn computed (its prompt and 5 of its 6 tokens): the system's, held by b, and its own, idle.
    assert hits == {True: [0, 16, 20], False: [0, 0, 0]}
    assert records[True][0].turn_prefill_tokens == [18, 26 - 20] and records[True][0].kv_recomputes == 1
    for got, expected in zip(records[True], records[False]):
        assert got.response_ids == expected.response_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(expected.logprobs), atol=1e-5, rtol=0)


def test_prefix_caching_can_be_turned_off(tiny_model_dir):
    engine = make_engine(tiny_model_dir, False)
    prompt = [1] + list(range(40, 61))
    run(engine, prompt, GREEDY)
    assert run(engine, prompt, GREEDY)[2] == 0
    assert not engine.block_manager.cached_block_ids
    assert engine.stats["prefill_tokens"] == 2 * len(prompt)


@pytest.mark.gpu
def test_prefix_cache_and_chunks_match_the_plain_engine_on_cuda(tiny_model_dir):
    cached = make_engine(tiny_model_dir, True, device="cuda", dtype="float32", max_num_batched_tokens=64)
    plain = make_engine(tiny_model_dir, False, device="cuda", dtype="float32")
    base = [1] + list(range(10, 80))
    for tail in ([90, 91, 92], [93, 94], [95]):
        params = SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True)
        assert_same(run(cached, base + tail, params), run(plain, base + tail, params))
    assert cached.stats["prefix_cache_hit_tokens"] == 2 * 68
