"""KV eviction (rollout/engine/kv_eviction.py): a sequence keeps kv_budget_tokens cache slots; what it keeps is exactly
what it attends to, its blocks go back, and snapkv keeps the past its latest queries attend to most."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import EngineConfig
from rollout.engine.kv_eviction import KVEvictor, compact
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.kv.cache import KVCache
from rollout.kv.quantized import QuantizedKVCache, block_codec
from rollout.model.tiny import write_tiny_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_layer_dir(tmp_path_factory):
    """One layer: a token's keys and values do not depend on what it attended to, so a compacted cache equals
    transformers' run over the whole sequence with the evicted keys masked out."""
    return write_tiny_model(tmp_path_factory.mktemp("one-layer") / "m", num_layers=1, seed=3)


def test_window_eviction_attends_to_exactly_the_sinks_and_the_recent_tokens(one_layer_dir):
    engine = LLMEngine(EngineConfig(model=str(one_layer_dir), block_size=4, max_model_len=128, kv_eviction="window",
                                    kv_budget_tokens=24, kv_sink_tokens=4, kv_observation_window=4))
    prompt = torch.randint(3, 100, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    engine.add_request("r", prompt, SamplingParams(temperature=1.0, max_tokens=60, seed=1, ignore_eos=True))
    [seq] = engine.requests["r"]
    tokens, logprobs, evicted_before = [], [], []
    while engine.has_unfinished_requests():
        evicted_before.append(seq.num_evicted_tokens)
        slots = len(seq.block_table) * 4
        assert slots <= 24 + 4 + 4 or seq.num_evicted_tokens == 0  # the budget, the block that triggers, the next
        for out in engine.step():
            tokens.append(out.token_id)
            logprobs.append(out.logprob)
    assert engine.stats["kv_evicted_tokens"] > 60  # compacted several times
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    hf_model = AutoModelForCausalLM.from_pretrained(one_layer_dir).eval()
    sequence = prompt + tokens
    for i, (token, logprob, evicted) in enumerate(zip(tokens, logprobs, evicted_before)):
        query = len(prompt) + i - 1  # the position whose logits sampled token i
        visible = torch.zeros(query + 1, dtype=torch.long)
        visible[:4] = 1
        visible[4 + evicted :] = 1
        with torch.no_grad():
            logits = hf_model(torch.tensor([sequence[: query + 1]]), attention_mask=visible[None],
                              position_ids=torch.arange(query + 1)[None]).logits[0, -1]
        expected = torch.log_softmax(logits.float(), -1)[token]
        assert abs(expected.item() - logprob) < 1e-4, (i, evicted)
    assert max(evicted_before) > 0


def test_compact_moves_the_chosen_slots_of_each_layer_and_head():
    cache = KVCache(2, 12, 4, 2, 8, torch.float32, torch.device("cpu"))
    cache.keys.normal_()
    cache.values.normal_()
    old_table, new_table = [5, 2, 9], [7, 0]
    keep = torch.tensor([[[0, 3, 4, 10, 11], [1, 2, 6, 8, 11]], [[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]]])
    before_k, before_v = cache.keys.clone(), cache.values.clone()
    compact(cache, old_table, new_table, keep)
    for layer in range(2):
        for head in range(2):
            for target, slot in enumerate(keep[layer, head].tolist()):
                src = (old_table[slot // 4], slot % 4)
                dst = (new_table[target // 4], target % 4)
                assert torch.equal(cache.keys[layer, dst[0], dst[1], head], before_k[layer, src[0], src[1], head])
                assert torch.equal(cache.values[layer, dst[0], dst[1], head], before_v[layer, src[0], src[1], head])


def test_snapkv_keeps_sinks_recent_and_the_most_attended_per_head(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, max_model_len=128, kv_eviction="snapkv",
                                    kv_budget_tokens=12, kv_sink_tokens=2, kv_observation_window=3))
    evictor = engine.evictor
    importance = torch.zeros(2, 2, 20)
    importance[0, 0, [5, 9, 14, 7]] = torch.tensor([0.9, 0.8, 0.7, 0.6])
    importance[0, 1, [3, 4, 10, 12]] = torch.tensor([0.5, 0.4, 0.3, 0.2])
    importance[1, :, 16] = 1.0  # a recent slot: kept anyway
    importance[1, :, [2, 3, 4, 5, 6, 8]] = torch.tensor([0.6, 0.5, 0.4, 0.3, 0.2, 0.1])
    keep = evictor.select(20, list(importance))
    for layer in range(2):
        for head in range(2):
            kept = keep[layer, head].tolist()
            assert len(kept) == 12 and kept == sorted(kept)
            assert kept[:2] == [0, 1] and kept[-3:] == [17, 18, 19]
            middle = importance[layer, head, 2:17]
            expected = (middle.topk(7).indices + 2).sort().values.tolist()
            assert kept[2:-3] == expected
    assert set(keep[0, 0].tolist()) >= {5, 9, 14, 7}
    assert set(keep[1, 0].tolist()) >= {2, 3, 4, 5, 6, 8}


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int4"])
def test_snapkv_observes_the_latest_queries_and_runs_to_the_end(tiny_model_dir, kv_cache_dtype):
    """The observed attention of a decode query is a probability distribution over the sequence's slots, and
    generation under eviction (also with the int4 resident cache) returns every block."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, max_model_len=160, kv_eviction="snapkv",
                                    kv_budget_tokens=20, kv_sink_tokens=2, kv_observation_window=4,
                                    kv_cache_dtype=kv_cache_dtype))
    prompts = [torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 9, 25)]
    observed = []
    run = engine.runner.run

    def spy(batch):
        result = run(batch)
        observed.extend((seq_id, rows) for seq_id, rows in engine.runner.observations.items())
        return result

    engine.runner.run = spy
    outputs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=50, n=2, seed=3, ignore_eos=True))
    assert all(len(c.token_ids) == 50 for out in outputs for c in out.completions)
    assert engine.stats["kv_evicted_tokens"] > 0
    assert observed
    for _, rows in observed:
        assert len(rows) == 2  # one per layer
        for layer in rows:
            assert layer.shape[0] == 2  # kv heads
            torch.testing.assert_close(layer.sum(-1), torch.ones(2), atol=1e-5, rtol=0)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_eviction_settings_are_checked(tiny_model_dir):
    with pytest.raises(ValueError, match="kv_budget_tokens"):
        EngineConfig(model=str(tiny_model_dir), kv_eviction="window", kv_budget_tokens=10, kv_sink_tokens=4,
                     kv_observation_window=8)
    assert isinstance(LLMEngine(EngineConfig(model=str(tiny_model_dir), kv_eviction="window")).evictor, KVEvictor)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_snapkv_selects_and_compacts_on_the_cache_device(tiny_model_dir, kv_cache_dtype):
    """On CUDA, select concatenated CPU index tensors with the device's attention scores ("Expected all tensors to
    be on the same device", issue 28). The meta device has the same checks and no data: selection and compaction
    run there with every index tensor on the cache's device, and nothing is read back to the host."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, max_model_len=128, kv_eviction="snapkv",
                                    kv_budget_tokens=12, kv_sink_tokens=2, kv_observation_window=3))
    meta = torch.device("meta")
    evictor = engine.evictor
    evictor.cache = (KVCache(2, 12, 4, 2, 8, torch.float32, meta) if kv_cache_dtype == "auto" else
                     QuantizedKVCache(2, 12, 4, 2, 8, torch.float32, meta, block_codec(kv_cache_dtype, 4), 2))
    keep = evictor.select(20, [torch.rand(2, 20, device=meta) for _ in range(2)])
    assert keep.device == meta and keep.shape == (2, 2, 12)
    assert evictor.select(20, None).device == meta  # nothing observed: the window's choice
    compact(evictor.cache, [5, 2, 9, 1, 3], [7, 0, 4], keep)
