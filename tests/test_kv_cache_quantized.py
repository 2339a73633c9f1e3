"""The quantized resident KV cache (rollout/kv/quantized.py): what it stores and reads back, its pool of open
blocks, and the engine on it: close to the float cache, prefix caching and n > 1 intact (its block accounting is
tested with the others' in test_engine_kv.py)."""

import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine.kv_handoff import add_prefilled_request, prefill_for_transfer
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.kv.quantized import QuantizedKVCache, block_codec

torch.set_num_threads(1)
LAYERS, BLOCK, HEADS, DIM = 2, 4, 2, 32


def make_cache(bits: str = "int8", num_blocks: int = 8, num_open_blocks: int = 4) -> QuantizedKVCache:
    return QuantizedKVCache(LAYERS, num_blocks, BLOCK, HEADS, DIM, torch.float32, torch.device("cpu"),
                            block_codec(bits, BLOCK), num_open_blocks)


def tokens(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer keys and values of `count` tokens, [layers, count, heads, dim]; keys with an outlier channel."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(LAYERS, count, HEADS, DIM, generator=gen)
    keys[..., 3] += 8
    return keys, torch.randn(LAYERS, count, HEADS, DIM, generator=gen)


def write(cache: QuantizedKVCache, slots: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
    """One forward pass's writes: every layer in order, as attention does."""
    slot_mapping = torch.tensor(slots)
    for layer in range(LAYERS):
        cache.write(layer, slot_mapping, keys[layer], values[layer])


def read(cache: QuantizedKVCache, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[layers, block_size, heads, dim] keys and values of one block, as attention reads them."""
    pairs = [[t[0].clone() for t in cache.read_blocks(layer, torch.tensor([block]))] for layer in range(LAYERS)]
    return torch.stack([k for k, _ in pairs]), torch.stack([v for _, v in pairs])


def codec_round_trip(bits: str, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The wire codec's decode(encode(.)) of one block's tokens, per layer: what a closed block must read back."""
    codec = block_codec(bits, BLOCK)
    out = [codec.decode(codec.encode(keys[layer : layer + 1], values[layer : layer + 1])) for layer in range(LAYERS)]
    return torch.cat([k for k, _ in out]), torch.cat([v for _, v in out])


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_blocks_read_back_as_the_codec_encodes_them(bits):
    cache = make_cache(bits)
    one_by_one, whole, partial = tokens(BLOCK, 0), tokens(BLOCK, 1), tokens(2, 2)
    for i in range(BLOCK):  # block 1, one token per step as decode writes it
        write(cache, [BLOCK + i], one_by_one[0][:, i : i + 1], one_by_one[1][:, i : i + 1])
        assert cache.num_open == (0 if i == BLOCK - 1 else 1)  # quantized when its last slot is written
    write(cache, [3 * BLOCK + i for i in range(BLOCK)] + [5 * BLOCK, 5 * BLOCK + 1],  # block 3 whole, block 5 begun
          torch.cat([whole[0], partial[0]], dim=1), torch.cat([whole[1], partial[1]], dim=1))
    assert cache.num_open == 1 and cache.open_slot[5] >= 0 and cache.open_slot[3] == -1
    for block, (keys, values) in ((1, one_by_one), (3, whole)):
        expected = codec_round_trip(bits, keys, values)
        got = read(cache, block)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        error = (got[0] - keys).norm() / keys.norm()
        assert (1e-4 if bits == "int8" else 1e-2) < error < (0.02 if bits == "int8" else 0.3)
    keys, values = read(cache, 5)  # open: the tokens exactly as written
    assert torch.equal(keys[:, :2], partial[0]) and torch.equal(values[:, :2], partial[1])


def test_a_full_pool_closes_its_least_recent_block_and_reopens_it_on_the_next_write():
    cache = make_cache("int8", num_open_blocks=2)
    first = tokens(3, 0)
    write(cache, [0, 1, 2], *first)  # block 0: three tokens, open
    write(cache, [4], *tokens(1, 1))  # block 1 open
    write(cache, [8], *tokens(1, 2))  # block 2 needs a slot: block 0, the least recent, is closed as it is
    assert cache.open_slot[0] == -1 and cache.num_open == 2
    # closed partly filled: its unwritten slot repeats the last token, so the key ranges are those of its 3 tokens
    padded = tuple(torch.cat([t, t[:, 2:3]], dim=1) for t in first)
    expected = codec_round_trip("int8", *padded)
    keys, _ = read(cache, 0)
    assert torch.equal(keys, expected[0])
    last = tokens(1, 3)
    write(cache, [3], *last)  # reopened (block 1 closed instead), filled, quantized again
    assert cache.open_slot[0] == -1 and cache.open_slot[1] == -1 and cache.num_open == 1
    keys, values = read(cache, 0)
    original = torch.cat([first[0], last[0]], dim=1), torch.cat([first[1], last[1]], dim=1)
    assert (keys - original[0]).abs().max() < 0.1 and (values - original[1]).abs().max() < 0.05


def test_a_write_with_more_open_blocks_than_the_pool_closes_the_extra_ones_when_it_ends():
    cache = make_cache("int4", num_open_blocks=2)
    slots = [b * BLOCK + i for b in range(5) for i in range(2)]  # 5 partly filled blocks (a large scoring prefill)
    keys, values = tokens(len(slots), 4)
    write(cache, slots, keys, values)
    assert cache.num_open == 2 and cache.open_keys.shape[1] == 2
    for b in range(5):
        got, _ = read(cache, b)
        assert (got[:, :2] - keys[:, 2 * b : 2 * b + 2]).abs().max() < 1.0  # int4 steps of a range of ~4 sigma


def test_copy_blocks_copies_open_and_closed_blocks_and_export_import_round_trips():
    cache = make_cache("int8")
    write(cache, list(range(BLOCK + 2)), *tokens(BLOCK + 2, 5))  # block 0 closed, block 1 open
    cache.copy_blocks([0, 1], [6, 7])
    assert cache.open_slot[7] >= 0 and cache.open_slot[7] != cache.open_slot[1] and cache.open_slot[6] == -1
    for src, dst in ((0, 6), (1, 7)):
        assert all(torch.equal(a, b) for a, b in zip(read(cache, src), read(cache, dst)))
    write(cache, [7 * BLOCK + 2], *tokens(1, 6))  # the copy diverges (copy-on-write); the source does not move
    assert torch.equal(read(cache, 1)[0][:, :2], read(cache, 7)[0][:, :2])
    assert not torch.equal(read(cache, 1)[0][:, 2], read(cache, 7)[0][:, 2])
    keys, values = cache.export_blocks([0, 1])
    other = make_cache("int8")
    other.import_blocks([2, 3], keys, values)
    for src, dst in ((0, 2), (1, 3)):
        (k1, v1), (k2, v2) = read(cache, src), read(other, dst)
        assert (k1 - k2).abs().max() < 0.05 and (v1 - v2).abs().max() < 0.02  # requantized dequantized values


def test_the_same_budget_holds_more_blocks(tiny_model_dir):
    def config(kv_cache_dtype):
        return EngineConfig(model=str(tiny_model_dir), kv_cache_dtype=kv_cache_dtype, kv_cache_memory_bytes=8 << 20,
                            max_model_len=512, max_num_seqs=128)
    full, int8, int4 = config("auto"), config("int8"), config("int4")
    # 2 layers x 2 kv heads x head_dim 32 x 16 tokens, float32: 16,384 bytes a block (1,024 a token). int8: codes
    # 1 byte a value; key min + scale (float16) per channel per block; value min + scale per token per 32 channels.
    assert full.kv_bytes_per_block == 16384 and full.kv_open_blocks == 0
    assert int8.kv_bytes_per_block == 2 * (2 * 16 * 2 * 32 + 2 * 2 * 2 * 32 + 2 * 2 * 16 * 2) == 4864
    assert int4.kv_bytes_per_block == 2 * (2 * 16 * 2 * 16 + 2 * 2 * 2 * 32 + 2 * 2 * 16 * 2) == 2816
    open_bytes = 128 * 16384  # one float block per running sequence, paid from the same budget
    assert full.num_blocks == (8 << 20) // 16384 == 512
    assert int8.num_blocks == ((8 << 20) - open_bytes) // 4864 == 1293
    assert int4.num_blocks == ((8 << 20) - open_bytes) // 2816 == 2234
    with pytest.raises(ValueError, match="open float blocks"):
        EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="int4", kv_cache_memory_bytes=open_bytes,
                     max_model_len=512, max_num_seqs=128)


PROMPTS = [[3 + (i * 7 + j * 5) % 90 for j in range(length)] for i, length in enumerate([5, 16, 33, 17, 48, 9, 24, 3])]


def generate(model_dir, kv_cache_dtype, prompts=PROMPTS, params=None, **kwargs):
    kwargs = {"block_size": 4, "num_blocks": 256, "max_model_len": 128, "max_num_seqs": 8, "max_n": 4, **kwargs}
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_cache_dtype=kv_cache_dtype, **kwargs))
    params = params or SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return engine, [output.completions for output in engine.generate(prompts, params)]


def agreement(outputs, reference) -> tuple[float, float]:
    """Share of greedy tokens equal position by position, and mean |logprob difference| up to each first difference."""
    equal = total = 0
    diffs = []
    for (ours,), (theirs,) in zip(outputs, reference):
        total += len(theirs.token_ids)
        equal += sum(a == b for a, b in zip(ours.token_ids, theirs.token_ids))
        same = next((i for i, (a, b) in enumerate(zip(ours.token_ids, theirs.token_ids)) if a != b), len(ours.token_ids))
        diffs += [abs(a - b) for a, b in zip(ours.logprobs[:same], theirs.logprobs[:same])]
    return equal / total, sum(diffs) / len(diffs)


def test_the_engine_on_a_quantized_cache_stays_close_to_the_float_cache(sharp_model_dir):
    # Measured here (block_size 4: most of each context is quantized): int8 agrees on 100% of 192 greedy tokens,
    # mean |logprob diff| 0.0027; int4 agrees on 60%, 0.043 up to each first difference.
    _, reference = generate(sharp_model_dir, "auto")
    _, int8 = generate(sharp_model_dir, "int8")
    _, int4 = generate(sharp_model_dir, "int4")
    int8_agree, int8_diff = agreement(int8, reference)
    int4_agree, int4_diff = agreement(int4, reference)
    assert int8_agree >= 0.9 and 1e-4 < int8_diff < 0.01
    assert int4_agree >= 0.4 and int8_diff < int4_diff < 0.15


def test_prefix_caching_and_copy_on_write_on_a_quantized_cache(sharp_model_dir):
    prompts = [PROMPTS[2], PROMPTS[2][:30] + [7, 8], PROMPTS[4]]  # 33 tokens: the last block is partly filled
    params = SamplingParams(temperature=0, max_tokens=16, n=3, ignore_eos=True)
    for kv_cache_dtype in ("int8", "int4"):
        cached_engine, first = generate(sharp_model_dir, kv_cache_dtype, prompts, params)
        cached = [output.completions for output in cached_engine.generate(prompts, params)]  # the prompts again
        _, fresh = generate(sharp_model_dir, kv_cache_dtype, prompts, params, enable_prefix_caching=False)
        # their full blocks from the cache (one token of a prompt that fills its blocks is always computed)
        assert cached_engine.stats["prefix_cache_hit_tokens"] == 32 + 28 + 44
        for ours, theirs in zip(cached + first, fresh + fresh):
            # n = 3 greedy completions share the prompt's blocks, then copy the partly filled one: all equal
            assert all(c.token_ids == ours[0].token_ids for c in ours)
            assert ours[0].token_ids == theirs[0].token_ids
            assert max(abs(a - b) for a, b in zip(ours[0].logprobs, theirs[0].logprobs)) < 1e-4


def test_a_quantized_decode_worker_imports_a_prefilled_prompt(sharp_model_dir):
    kwargs = {"block_size": 4, "num_blocks": 128, "max_model_len": 128, "max_num_seqs": 8, "max_n": 4}
    prefill = LLMEngine(EngineConfig(model=str(sharp_model_dir), kv_cache_dtype="int8", **kwargs))
    decode = LLMEngine(EngineConfig(model=str(sharp_model_dir), kv_cache_dtype="int8", **kwargs))
    params = SamplingParams(temperature=0, max_tokens=12, n=2, seed=3, ignore_eos=True)
    _, alone = generate(sharp_model_dir, "int8", [PROMPTS[2]], params)
    prefilled = prefill_for_transfer(prefill, "r", PROMPTS[2], params)
    add_prefilled_request(decode, "r", prefilled, params)
    tokens_of = {0: [], 1: []}
    while decode.has_unfinished_requests():
        for out in decode.step():
            tokens_of[out.index].append(out.token_id)
    assert tokens_of[0][:11] == alone[0][0].token_ids[1:] and tokens_of[1] == tokens_of[0]
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_a_read_dequantizes_only_the_blocks_asked_for_in_the_model_dtype(bits):
    """read_blocks decoded into float32 and copied into the workspace (issue 28): in a bfloat16 cache a read makes
    no float32 tensor, and no temporary larger than the blocks it returns; the values are the codec's decode."""
    from torch.utils import _pytree as pytree
    from torch.utils._python_dispatch import TorchDispatchMode

    class Outputs(TorchDispatchMode):
        """The tensors ops allocate (not views, not in-place results): (op, dtype, numel)."""

        def __init__(self):
            super().__init__()
            self.seen: list[tuple[str, torch.dtype, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {a.untyped_storage().data_ptr() for a in pytree.tree_leaves((args, kwargs))
                      if isinstance(a, torch.Tensor)}
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                    self.seen.append((str(func), t.dtype, t.numel()))
            return out

    cache = QuantizedKVCache(LAYERS, 64, BLOCK, HEADS, DIM, torch.bfloat16, torch.device("cpu"),
                             block_codec(bits, BLOCK), num_open_blocks=4)
    keys, values = tokens(8 * BLOCK + 2, 3)  # blocks 0-7 closed, block 8 open
    write(cache, list(range(8 * BLOCK + 2)), keys.bfloat16(), values.bfloat16())
    asked = torch.tensor([1, 8, 5])
    cache.read_blocks(0, asked)  # the workspace, once
    with Outputs() as recorder:
        k, v = cache.read_blocks(1, asked)
    assert k.dtype == torch.bfloat16
    assert not [o for o in recorder.seen if o[1] == torch.float32], recorder.seen
    assert max(n for _, _, n in recorder.seen) <= asked.numel() * BLOCK * HEADS * DIM
    codec = block_codec(bits, BLOCK)
    expected = codec.decode(codec.encode(*(t[1, BLOCK : 2 * BLOCK].bfloat16()[None] for t in (keys, values))))
    assert torch.equal(k[0], expected[0][0]) and torch.equal(v[0], expected[1][0])
    assert torch.equal(k[1, :2], keys[1, 8 * BLOCK :].bfloat16())  # the open block, as written
