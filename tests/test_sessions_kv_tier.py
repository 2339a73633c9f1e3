"""The host KV tier of idle sessions (rollout/kv/host_tier.py) in the native engine: a session whose KV left the
cache for the tier continues exactly as one whose KV never left (plain copies; quantized copies within the quantized
cache's agreement check), the tier keeps to its byte budget, and weight updates treat tiered KV by kv_on_update."""

import pytest
import torch
from safetensors.torch import load_file

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.outputs import TokenOutput
from rollout.engine.sampling_params import SamplingParams

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NAMES = "abc"


def make_engine(model_dir, num_blocks: int, **settings) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), block_size=8, num_blocks=num_blocks, max_model_len=96,
                                  **settings))


def turn(engine: LLMEngine, session_id: str, request_id: str, params=GREEDY) -> list[TokenOutput]:
    engine.add_session_request(request_id, session_id, params)
    outputs = []
    while request_id in engine.requests:
        outputs += [out for out in engine.step() if out.request_id == request_id and out.token_id is not None]
    return outputs


def play(engine: LLMEngine, turns: int = 3, names: str = NAMES) -> dict[str, list[TokenOutput]]:
    """Sessions of ~40 tokens taking turns (12 blocks of 8 cannot hold three): each one's outputs."""
    outputs: dict[str, list[TokenOutput]] = {name: [] for name in names}
    for name in names:
        engine.open_session(name, [1] + [20 + (ord(name) * 7 + i * 3) % 70 for i in range(30)])
    for t in range(turns):
        for name in names:
            if t:
                engine.append_to_session(name, [5 + t, 6, 7])
            outputs[name] += turn(engine, name, f"{name}{t}")
    return outputs


def tokens(outputs: list[TokenOutput]) -> list[int]:
    return [out.token_id for out in outputs]


def test_plain_tier_continues_token_exact_without_recomputing(tiny_model_dir):
    resident = play(make_engine(tiny_model_dir, num_blocks=128))
    engine = make_engine(tiny_model_dir, num_blocks=12, session_kv_tier_bytes=1 << 22)
    tiered = play(engine)
    stats = engine.stats
    assert stats["session_tier_hits"] >= 3 and stats["session_tier_tokens_restored"] > 100
    assert stats["session_tier_bytes_in"] > 0 and stats["session_tier_misses"] == 0
    for name in NAMES:
        assert tokens(tiered[name]) == tokens(resident[name])
        diff = max(abs(a.logprob - b.logprob) for a, b in zip(tiered[name], resident[name]))
        assert diff < 1e-5, f"session {name}: logprobs differ by {diff}"
        assert engine.close_session(name).kv_recomputes == 0  # every turn's context came back from the tier
    assert engine.block_manager.num_free_blocks == 12 and engine.stats["session_tier_bytes"] == 0


def test_without_a_tier_the_same_sessions_recompute(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=12)
    play(engine)
    assert sum(engine.close_session(name).kv_recomputes for name in NAMES) > 0
    assert engine.stats["session_tier_puts"] == 0


def agreement(ours: dict[str, list[TokenOutput]], theirs: dict[str, list[TokenOutput]]) -> float:
    """Share of the sessions' greedy tokens equal position by position (test_kv_cache_quantized.py's measure)."""
    equal = sum(a.token_id == b.token_id for name in NAMES for a, b in zip(ours[name], theirs[name]))
    return equal / sum(len(theirs[name]) for name in NAMES)


@pytest.mark.parametrize(("codec", "bar"), [("int8", 0.9), ("int4", 0.4)])  # test_kv_cache_quantized.py's bars
def test_compressed_tier_agrees_within_the_lossy_kv_check_and_is_smaller(sharp_model_dir, codec, bar):
    resident = play(make_engine(sharp_model_dir, num_blocks=128))
    plain = make_engine(sharp_model_dir, num_blocks=12, session_kv_tier_bytes=1 << 22)
    play(plain)
    engine = make_engine(sharp_model_dir, num_blocks=12, session_kv_tier_bytes=1 << 22, session_kv_tier_codec=codec)
    tiered = play(engine)
    assert engine.stats["session_tier_hits"] >= 3
    assert agreement(tiered, resident) >= bar, agreement(tiered, resident)
    per_token = engine.stats["session_tier_bytes_out"] / engine.stats["session_tier_tokens_restored"]
    plain_per_token = plain.stats["session_tier_bytes_out"] / plain.stats["session_tier_tokens_restored"]
    assert per_token < plain_per_token / 2


def test_the_tier_keeps_to_its_budget(tiny_model_dir):
    probe = make_engine(tiny_model_dir, num_blocks=12, session_kv_tier_bytes=1 << 22)
    budget = int(probe.sessions.tier.nbytes_for(48))  # about one session's context
    engine = make_engine(tiny_model_dir, num_blocks=12, session_kv_tier_bytes=budget)
    resident = play(make_engine(tiny_model_dir, num_blocks=128), turns=2, names="abcde")
    original = engine.sessions.tier.put
    seen = []

    def put(*args):
        kept = original(*args)
        seen.append(engine.sessions.tier.bytes_used)
        return kept

    engine.sessions.tier.put = put
    tiered = play(engine, turns=2, names="abcde")
    assert seen and max(seen) <= budget
    assert engine.stats["session_tier_dropped"] > 0 and engine.stats["session_tier_hits"] > 0
    for name in "abcde":  # a session dropped from the tier recomputes: still the same tokens
        assert tokens(tiered[name]) == tokens(resident[name])


@pytest.fixture(scope="module")
def new_weights(tiny_model_dir):
    gen = torch.Generator().manual_seed(7)
    return {name: t + torch.randn(t.shape, generator=gen) * 0.05
            for name, t in load_file(tiny_model_dir / "model.safetensors").items()}


def across_update(model_dir, new_weights, kv_on_update: str, tiered: bool) -> tuple[LLMEngine, list[TokenOutput]]:
    """A session's first turn, its KV moved to the tier (`tiered`) or left in the cache, new weights, its next turn."""
    engine = make_engine(model_dir, num_blocks=64, session_kv_tier_bytes=1 << 22 if tiered else 0,
                         kv_on_update=kv_on_update)
    engine.open_session("s", [1] + list(range(30, 60)))
    turn(engine, "s", "t1")
    engine.append_to_session("s", [5, 6, 7])
    if tiered:
        assert engine.sessions.evict_idle() and engine.stats["session_tier_bytes"] > 0
    engine.load_weights(new_weights, version=1)
    return engine, turn(engine, "s", "t2")


@pytest.mark.parametrize("kv_on_update", ["keep", "recompute"])
def test_a_weight_update_across_a_tiered_session(tiny_model_dir, new_weights, kv_on_update):
    engine, after = across_update(tiny_model_dir, new_weights, kv_on_update, tiered=True)
    _, resident = across_update(tiny_model_dir, new_weights, kv_on_update, tiered=False)
    assert tokens(after) == tokens(resident)
    assert max(abs(a.logprob - b.logprob) for a, b in zip(after, resident)) < 1e-5
    record = engine.close_session("s")
    if kv_on_update == "keep":  # the tier's KV came back, still of version 0, and says so
        assert engine.stats["session_tier_hits"] == 1 and after[-1].kv_version == 0 and record.kv_version == 0
        assert record.kv_recomputes == 0
    else:  # the update dropped the tier: the turn recomputed its context with the new weights
        assert engine.stats["session_tier_hits"] == 0 and after[-1].kv_version == 1 and record.kv_version == 1
        assert record.kv_recomputes == 1


def test_settings_are_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="session_kv_tier_codec"):
        EngineConfig(model=str(tiny_model_dir), session_kv_tier_codec="int2")
    with pytest.raises(ValueError, match="session_kv_tier_bytes"):
        EngineConfig(model=str(tiny_model_dir), session_kv_tier_bytes=-1)


def test_a_turn_queued_while_running_requests_hold_the_blocks_waits_for_its_tiered_kv(tiny_model_dir):
    engine = make_engine(tiny_model_dir, num_blocks=12, session_kv_tier_bytes=1 << 22)
    engine.open_session("s", [1] + list(range(30, 60)))
    turn(engine, "s", "t1")
    assert engine.sessions.evict_idle()  # its 39 tokens (5 blocks) go to the tier
    engine.add_request("busy", [2] * 60, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    engine.step()  # the plain request holds 8 of the 12 blocks, and grows
    engine.append_to_session("s", [5, 6, 7])
    assert engine.block_manager.num_free_blocks < 5
    after = turn(engine, "s", "t2")  # queued behind it: its KV comes back once blocks are free, not recomputed
    record = engine.close_session("s")
    assert len(after) == GREEDY.max_tokens and record.kv_recomputes == 0
    assert engine.stats["session_tier_hits"] == 1 and engine.stats["session_tier_misses"] == 0


@pytest.mark.parametrize(("policy", "kept"), [("lru", {"b", "c"}), ("kv_aware", {"a", "b"})])
def test_a_full_tier_drops_by_the_policy(tiny_model_dir, policy, kept):
    # Room in the tier for two of the three sessions. lru moves them out oldest first (a, b, c) and the tier drops its
    # oldest entry (a); kv_aware moves out c (back in ten minutes) first, then b, then a, and the full tier drops the
    # session back last (c), not the oldest entry.
    probe = make_engine(tiny_model_dir, num_blocks=64, session_kv_tier_bytes=1 << 22)
    engine = make_engine(tiny_model_dir, num_blocks=64, session_kv_tier_bytes=2 * probe.sessions.tier.nbytes_for(39),
                         session_policy=policy)
    for name, idle_s in (("a", 5.0), ("b", 20.0), ("c", 600.0)):
        engine.open_session(name, [1] + [20 + (ord(name) + i) % 70 for i in range(30)])
        engine.add_session_request(name, name, GREEDY, idle_s)
        while name in engine.requests:
            engine.step()
    for _ in "abc":
        assert engine.sessions.evict_idle()
    assert set(engine.sessions.tier.entries) == kept


def test_sessions_moved_out_to_make_room_for_a_restore_never_push_its_kv_out_of_the_tier(tiny_model_dir):
    probe = make_engine(tiny_model_dir, num_blocks=12, session_kv_tier_bytes=1 << 22)
    engine = make_engine(tiny_model_dir, num_blocks=12, session_kv_tier_bytes=probe.sessions.tier.nbytes_for(60))
    engine.open_session("s", [1] + list(range(30, 60)))
    turn(engine, "s", "s1")
    assert engine.sessions.evict_idle()  # s's KV fills most of the tier
    for name in "tu":  # two idle sessions hold 10 of the 12 blocks
        engine.open_session(name, [1] + [20 + (ord(name) + i) % 70 for i in range(30)])
        turn(engine, name, f"{name}1")
    engine.append_to_session("s", [5, 6, 7])
    turn(engine, "s", "s2")  # its restore moves t out; t does not fit the tier beside s and is dropped, not s
    assert engine.stats["session_tier_hits"] == 1 and engine.close_session("s").kv_recomputes == 0
