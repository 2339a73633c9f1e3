"""KV accounting: whatever mix of completed, aborted and preempted requests, chunked prefills, prompts sharing
cached prefixes, weight updates, requests imported from a prefill engine (rollout/engine/kv_handoff.py) and KV eviction
(rollout/engine/kv_eviction.py), every block comes back (free or cached) and the prefix cache stays coherent."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.config import EngineConfig
from rollout.engine.block_manager import BlockManager
from rollout.engine.errors import QueueFull
from rollout.engine.kv_handoff import add_prefilled_request, prefill_for_transfer
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.sequence import Sequence
from rollout.kv.quantized import QuantizedKVCache
from rollout.model.tiny import write_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("kv") / "m", hidden_size=64, num_layers=1, num_heads=2,
                            num_kv_heads=1, head_dim=32, seed=2)


@pytest.fixture(scope="module", params=[("auto", "none"), ("auto", "window"), ("auto", "snapkv"), ("int4", "none"),
                                        ("int4", "snapkv")], ids=lambda p: "-".join(p))
def small_engine(small_model, request):
    # A budget of 8 tokens a step: most prompts are prefilled in chunks, beside decodes. With eviction, a sequence
    # keeps 12 cache slots (compacted when it reaches 16). The int4 cache's pool of 6 open blocks (one per sequence)
    # fills up: blocks are closed early and reopened.
    kv_cache_dtype, eviction = request.param
    return LLMEngine(EngineConfig(model=str(small_model), block_size=4, num_blocks=20, max_model_len=64, max_num_seqs=6,
                                  max_n=3, max_num_batched_tokens=8, kv_cache_dtype=kv_cache_dtype,
                                  kv_eviction=eviction, kv_budget_tokens=12, kv_sink_tokens=2, kv_observation_window=3))


@pytest.fixture(scope="module")
def prefill_engine(small_model):
    return LLMEngine(EngineConfig(model=str(small_model), block_size=4, num_blocks=40, max_model_len=64, max_n=3))


# Prompts share prefixes (of up to 7 blocks of 4 tokens) so that requests hit, share and evict cached blocks.
PREFIXES = [[3 + (i * 7 + k * 13) % 90 for i in range(28)] for k in range(2)]
request_strategy = st.fixed_dictionaries({
    "prefix": st.integers(0, 1),
    "shared_len": st.integers(0, 28),
    "tail_len": st.integers(0, 8),
    "max_tokens": st.integers(1, 28),  # the longest prompt (28 + 8) + 28 fits max_model_len 64: every request is valid
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 1.0]),
})
action_strategy = st.one_of(
    st.tuples(st.just("add"), request_strategy),
    st.tuples(st.just("import"), request_strategy),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("weights"), st.just(None)),
)


def assert_blocks_consistent(engine: LLMEngine) -> None:
    """Held blocks carry exactly the ref counts of the sequences holding them; the rest are free, plainly or as
    cached blocks (those, and only those, registered); a registered block holds the prefix its hash names."""
    manager = engine.block_manager
    holders = [0] * manager.num_blocks
    for seqs in engine.requests.values():
        for seq in seqs:
            for block_id in seq.block_table:
                holders[block_id] += 1
            assert seq.num_cached_tokens - seq.num_evicted_tokens <= len(seq.block_table) * manager.block_size
            hashes = manager.prefix_hashes(seq)
            for index, block_id in enumerate(seq.block_table[: seq.num_registered_blocks]):
                assert manager.block_hashes[block_id] in (None, hashes[index])
    assert holders == manager.ref_counts
    assert sorted([*manager.free_block_ids, *manager.evictable_block_ids]) == [
        b for b in range(manager.num_blocks) if holders[b] == 0]
    assert all(manager.block_hashes[b] is None for b in manager.free_block_ids)
    assert all(manager.block_hashes[b] is not None for b in manager.evictable_block_ids)
    assert {h: b for b, h in enumerate(manager.block_hashes) if h is not None} == manager.cached_block_ids
    cache = engine.runner.cache
    if isinstance(cache, QuantizedKVCache):  # its pool of open (float) blocks and their map agree
        assert cache.open_keys.shape[1] == cache.num_open_blocks >= cache.num_open
        assert [int(s) for s in cache.open_slot if s >= 0] == [cache._slot_of[b] for b in sorted(cache._slot_of)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(actions=st.lists(action_strategy, min_size=1, max_size=25), finish_by_abort=st.booleans())
def test_every_block_returns_to_the_free_list(small_engine, prefill_engine, actions, finish_by_abort):
    engine = small_engine
    weight = engine.runner.model.model.embed_tokens.weight.clone()
    added: list[str] = []
    for kind, arg in actions:
        if kind == "add":
            request_id = f"q{len(added)}"
            prompt = PREFIXES[arg["prefix"]][: arg["shared_len"]] + [95 + len(added) % 5] * arg["tail_len"]
            params = SamplingParams(temperature=arg["temperature"], max_tokens=arg["max_tokens"], n=arg["n"], seed=1)
            engine.add_request(request_id, prompt or [1], params)
            added.append(request_id)
        elif kind == "import":
            request_id = f"q{len(added)}"
            prompt = PREFIXES[arg["prefix"]][: arg["shared_len"]] + [95 + len(added) % 5] * arg["tail_len"]
            params = SamplingParams(temperature=arg["temperature"], max_tokens=arg["max_tokens"], n=arg["n"], seed=1)
            prefill_engine.load_weights({}, engine.weight_version)
            prefilled = prefill_for_transfer(prefill_engine, request_id, prompt or [1], params)
            try:
                add_prefilled_request(engine, request_id, prefilled, params)
            except QueueFull:  # the blocks are not free now: a decode worker retries later
                continue
            added.append(request_id)
        elif kind == "step":
            for _ in range(arg):
                engine.step()
        elif kind == "weights":
            engine.load_weights({"model.embed_tokens.weight": weight}, engine.weight_version + 1)
        elif added:
            engine.abort(added[arg % len(added)])
        assert_blocks_consistent(engine)
    if finish_by_abort:
        for request_id in added:
            engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
        assert_blocks_consistent(engine)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(count == 0 for count in engine.block_manager.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_copy_on_write_only_for_the_shared_partial_block():
    manager = BlockManager(num_blocks=8, block_size=4)
    params = SamplingParams()
    parent = Sequence(0, "r", 0, list(range(6)), params, seed=0)  # 6 tokens: one full block, one partial
    child = Sequence(1, "r", 1, list(range(6)), params, seed=0)
    manager.allocate(parent)
    manager.fork(parent, child)
    assert manager.ref_counts[parent.block_table[0]] == 2 and manager.num_free_blocks == 6
    for seq in (parent, child):
        seq.num_cached_tokens = 6
        seq.token_ids.append(7)  # the sampled token whose KV the next decode step writes at position 6
    copy = manager.may_append(parent)
    assert copy == (child.block_table[1], parent.block_table[1])  # parent got a private copy
    assert manager.may_append(child) is None  # the child is now the block's only holder
    assert parent.block_table[0] == child.block_table[0]
    manager.deallocate(parent)
    manager.deallocate(child)
    assert manager.num_free_blocks == 8 and set(manager.ref_counts) == {0}
