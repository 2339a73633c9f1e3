"""Paged attention in one Triton kernel, behind attention.paged_attention: decodes and prefill chunks read the KV
blocks in place through their block tables (no workspace gather), for a cache in the model dtype or quantized.

One program attends one sequence's queries of one kv head (its grouped query heads together: grouped-query
attention reads each key once for the whole group) over tiles of its context. A tile's keys are gathered token by
token through the block table (slot s is block table[s // block_size], offset s % block_size), so tiles need not
match blocks. A sequence's queries are the last of its context's slots (their KV was written before attention
runs), so query i of a chunk of n sees the slots up to context_len - n + i: causal masking within the chunk.
Softmax runs online in float32 (flash attention's running max and sum).

The quantized cache (rollout/kv/quantized.py) is read as it is stored: a closed block's int8 / int4 codes with
their float16 min and scale (rollout/kv/codecs.py: keys per channel over the block's tokens, values per token over
groups of channels, int4 two codes per byte along head_dim) are dequantized inside the kernel, and a block still
open (being filled) is read from the float pool, where `open_slot[block]` points. Each value is rounded to the model
dtype after dequantization, as the torch path's decode does, so both paths see the same keys and values.

A prefill program whose query tile lies past its sequence's new tokens (the grid has the step's longest chunk in
query tiles, so a decode mixed into a prefill step gets as many) reads nothing. A decode step with few sequences and
kv heads (too few programs to fill the GPU) splits each context into `decode_splits` partitions, one program each
(split-K, flash-decoding): each writes its softmax statistics and unnormalised output, and `_combine_splits` merges
them. The split depends on shapes alone (the batch, the block table's width), so a CUDA graph bucket's is fixed.

On CUDA the kernel is compiled (decode with a fixed grid, so CUDA graphs can replay it: rollout/engine/cuda_graphs.py);
on CPU tensors it runs in Triton's interpreter, which is how `make test` checks it against the torch path.
"""

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollout.kv.cache import KVCache, to_device
from rollout.kv.quantized import QuantizedKVCache

BLOCK_N = 32  # context slots per tile (16 on a quantized cache, whose dequantized tiles take more registers)
PREFILL_BLOCK_Q = 16  # queries of one sequence per program in a prefill step (decode: 1), fewer for wide groups
SPLIT_TARGET_PROGRAMS = 256  # a decode step splits contexts until it has about this many programs (2 per SM of an H100)
MIN_PARTITION = 64  # context slots per split at the least
MAX_SPLITS = 32


@dataclass(frozen=True)
class LaunchShape:
    """A launch's tile sizes and warps: chosen so that no variant spills registers on sm_90 (ptxas -v; checked on a
    CPU by tests/test_engine_attention_triton_compile.py): a program's query rows times head_dim at most 8192
    (4096 when the dots run in float32), 8 warps for the widest tiles and for quantized caches."""

    block_q: int  # queries of one sequence per program
    block_m: int  # query-head rows per program (block_q * group, a power of 2, >= 16 for tl.dot)
    block_d: int  # head_dim padded to a power of 2
    block_n: int  # context slots per tile
    num_warps: int


def launch_shape(decode: bool, group: int, head_dim: int, bits: int, upcast: bool) -> LaunchShape:
    block_d = max(16, triton.next_power_of_2(head_dim))
    budget = 8192 // (2 if upcast else 1)  # query-head rows x padded head_dim per program
    block_q = 1 if decode else max(1, min(PREFILL_BLOCK_Q, budget // block_d // group))
    block_m = max(16, triton.next_power_of_2(block_q * group))
    num_warps = 8 if bits or block_m * block_d >= budget else 4
    return LaunchShape(block_q, block_m, block_d, 16 if bits else BLOCK_N, num_warps)


def decode_splits(num_seqs: int, kv_heads: int, max_context: int) -> int:
    """How many partitions a decode step splits each context into: 1 when num_seqs * kv_heads programs already fill
    the GPU, else enough for about SPLIT_TARGET_PROGRAMS, each of MIN_PARTITION slots at the least."""
    programs = num_seqs * kv_heads
    if programs >= SPLIT_TARGET_PROGRAMS:
        return 1
    return max(1, min(triton.cdiv(SPLIT_TARGET_PROGRAMS, programs), triton.cdiv(max_context, MIN_PARTITION),
                      MAX_SPLITS))


@triton.jit
def _paged_attention(
    q_ptr, out_ptr, k_ptr, v_ptr, tables_ptr, query_starts_ptr, context_lens_ptr,
    open_slot_ptr, key_mins_ptr, key_scales_ptr, value_mins_ptr, value_scales_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,  # the float blocks (or a quantized cache's open pool): block, slot, head
    stride_cb, stride_cs, stride_ch,  # a quantized cache's code blocks (k_codes / v_codes share their layout)
    stride_mb, stride_mh,  # key mins / scales: block, head (one group per block: the token axis has size 1)
    stride_vb, stride_vs, stride_vh,  # value mins / scales: block, slot, head
    stride_table, stride_context,
    k_codes_ptr, v_codes_ptr,
    part_stats_ptr, part_acc_ptr, num_heads, num_splits, partition,  # split-K decode: [B, Hq, splits, 2 | HEAD_DIM]
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BITS: tl.constexpr, VALUE_GROUP: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    SPLIT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SPLIT:  # decode (one query tile): the third axis is the context's partition
        split = tl.program_id(2)
        tile = 0
    else:
        split = 0
        tile = tl.program_id(2)
    query_start = tl.load(query_starts_ptr + seq)
    query_len = tl.load(query_starts_ptr + seq + 1) - query_start
    context_len = tl.load(context_lens_ptr + seq * stride_context).to(tl.int32)

    rows = tl.arange(0, BLOCK_M)  # row r: query tile * BLOCK_Q + r // GROUP of head kv_head * GROUP + r % GROUP
    query = tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (query < query_len)
    query_slot = context_len - query_len + query  # the slot each query's token sits at: it sees the slots <= it
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_offsets = (query_start + query).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    running_max = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    running_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The tile's last query sees up to its own slot: later slots are never read; a tile with no query reads none.
    last_slot = tl.minimum(context_len, context_len - query_len + (tile + 1) * BLOCK_Q)
    last_slot = tl.where(tile * BLOCK_Q < query_len, last_slot, 0)
    first_slot = split * partition  # partition: a multiple of BLOCK_N (the whole context without a split)
    last_slot = tl.minimum(last_slot, first_slot + partition)
    for start in range(first_slot, last_slot, BLOCK_N):
        slots = start + tl.arange(0, BLOCK_N)
        slot_ok = slots < last_slot
        block = tl.load(tables_ptr + seq * stride_table + slots // BLOCK_SIZE, mask=slot_ok, other=0).to(tl.int64)
        offset = slots % BLOCK_SIZE
        kv_mask = slot_ok[:, None] & dim_ok[None, :]
        if BITS == 0:
            kv_offsets = block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        else:
            pool = tl.load(open_slot_ptr + block, mask=slot_ok, other=-1)
            is_open = pool >= 0
            pool_offsets = (tl.maximum(pool, 0)[:, None] * stride_kb + offset[:, None] * stride_ks
                            + kv_head * stride_kh + dims[None, :])
            open_mask = kv_mask & is_open[:, None]
            closed_mask = kv_mask & ~is_open[:, None]
            k_open = tl.load(k_ptr + pool_offsets, mask=open_mask, other=0.0)
            v_open = tl.load(v_ptr + pool_offsets, mask=open_mask, other=0.0)
            token = block[:, None] * stride_cb + offset[:, None] * stride_cs + kv_head * stride_ch
            if BITS == 8:
                k_code = tl.load(k_codes_ptr + token + dims[None, :], mask=closed_mask, other=0).to(tl.float32)
                v_code = tl.load(v_codes_ptr + token + dims[None, :], mask=closed_mask, other=0).to(tl.float32)
            else:  # two codes per byte: channel 2i in the low nibble, 2i + 1 in the high one
                shift = (dims % 2 * 4)[None, :]
                k_byte = tl.load(k_codes_ptr + token + dims[None, :] // 2, mask=closed_mask, other=0).to(tl.int32)
                v_byte = tl.load(v_codes_ptr + token + dims[None, :] // 2, mask=closed_mask, other=0).to(tl.int32)
                k_code = ((k_byte >> shift) & 0xF).to(tl.float32)
                v_code = ((v_byte >> shift) & 0xF).to(tl.float32)
            key_params = block[:, None] * stride_mb + kv_head * stride_mh + dims[None, :]
            k_min = tl.load(key_mins_ptr + key_params, mask=closed_mask, other=0.0).to(tl.float32)
            k_scale = tl.load(key_scales_ptr + key_params, mask=closed_mask, other=0.0).to(tl.float32)
            value_params = (block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh
                            + dims[None, :] // VALUE_GROUP)
            v_min = tl.load(value_mins_ptr + value_params, mask=closed_mask, other=0.0).to(tl.float32)
            v_scale = tl.load(value_scales_ptr + value_params, mask=closed_mask, other=0.0).to(tl.float32)
            k_closed = (k_code * k_scale + k_min).to(k_open.dtype)
            v_closed = (v_code * v_scale + v_min).to(v_open.dtype)
            k = tl.where(is_open[:, None], k_open, k_closed)
            v = tl.where(is_open[:, None], v_open, v_closed)
        if UPCAST:
            k, v = k.to(tl.float32), v.to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = slot_ok[None, :] & (slots[None, :] <= query_slot[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        probs = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, 1)
        acc = acc * correction[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=PRECISION)
        running_max = new_max

    if SPLIT:  # this partition's running max, sum and unnormalised output, merged by _combine_splits
        part = ((seq * num_heads + head) * num_splits + split).to(tl.int64)
        tl.store(part_stats_ptr + part * 2, running_max, mask=row_ok)
        tl.store(part_stats_ptr + part * 2 + 1, running_sum, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])
    else:
        out = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]  # a row that sees nothing (padding): 0
        out_offsets = (query_start + query).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


@triton.jit
def _combine_splits(part_stats_ptr, part_acc_ptr, out_ptr, query_starts_ptr, num_heads, num_splits,
                    stride_ot, stride_oh,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """One decode row's head: the softmax-weighted merge of its partitions (flash-decoding's reduction)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    part = ((seq * num_heads + head) * num_splits + splits).to(tl.int64)
    maxes = tl.load(part_stats_ptr + part * 2, mask=split_ok, other=-1.0e30)
    sums = tl.load(part_stats_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    weights = tl.exp(maxes - tl.max(maxes, 0))
    total = tl.sum(weights * sums, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], mask=split_ok[:, None] & dim_ok[None, :],
                  other=0.0)
    out = tl.sum(acc * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    token = tl.load(query_starts_ptr + seq).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)


@dataclass
class TritonAttention:
    """The block tables of one forward pass (or of one CUDA-graph bucket's static buffers), for every layer.

    Sequence i has the flat query rows query_starts[i] .. query_starts[i + 1] - 1, the last of its context_lens[i]
    cache slots, whose blocks are block_tables[i] (padded with any block id; only context slots are read). A row
    with context length 0 (a graph bucket's padding) reads nothing and outputs zeros."""

    block_tables: torch.Tensor  # [B, max_blocks] int32 or int64, rows of any stride, columns contiguous
    query_starts: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32 or int64, any stride
    max_query_len: int  # the grid's query tiles: 1 for a decode step
    scale: float
    num_splits: int | None = None  # a decode step's context partitions; None: decode_splits (tests force others)

    @classmethod
    def plan(cls, block_tables: Sequence[Sequence[int]], query_lens: Sequence[int], kv_lens: Sequence[int],
             block_size: int, scale: float, device: torch.device) -> "TritonAttention":
        """The step's sequences in the order of its flat query rows: each has query_lens[i] new tokens, the last of
        its kv_lens[i] cache slots, in the blocks of block_tables[i]. One host-to-device copy."""
        num_seqs = len(query_lens)
        width = max(-(-n // block_size) for n in kv_lens)
        rows = [[*table[:width], *[0] * (width - len(table))] for table in block_tables]
        flat = [*itertools.chain.from_iterable(rows), 0, *itertools.accumulate(query_lens), *kv_lens]
        packed = to_device(flat, torch.int32, device)
        tables = packed[: num_seqs * width].view(num_seqs, width)
        starts = packed[num_seqs * width : num_seqs * width + num_seqs + 1]
        return cls(tables, starts, packed[num_seqs * width + num_seqs + 1 :], max(query_lens), scale)

    def attend(self, q: torch.Tensor, layer: int, cache: KVCache | QuantizedKVCache) -> torch.Tensor:
        """q: [T, Hq, D] of the planned rows. Returns [T, Hq * D]."""
        return paged_attention_triton(q, layer, cache, self)


def paged_attention_triton(q: torch.Tensor, layer: int, cache: KVCache | QuantizedKVCache,
                           tables: TritonAttention) -> torch.Tensor:
    tokens, num_heads, head_dim = q.shape
    num_seqs = tables.context_lens.shape[0]
    group = num_heads // cache.num_kv_heads
    decode = tables.max_query_len == 1
    # float32 matmuls where the inputs are (exact ones: "ieee", not TF32) and in the interpreter, whose dot gets
    # 16-bit floats wrong (Triton 3.9); on CUDA a bfloat16/float16 cache multiplies in its dtype, accumulating in float32.
    upcast = q.dtype == torch.float32 or not q.is_cuda
    out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if isinstance(cache, QuantizedKVCache):
        bits = cache.codec.bits
        keys, values = cache.open_keys[layer], cache.open_values[layer]
        parts = {name: part[layer] for name, part in cache.parts.items()}
        k_codes, v_codes = parts["key_codes"], parts["value_codes"]
        key_mins, key_scales = parts["key_mins"], parts["key_scales"]
        value_mins, value_scales = parts["value_mins"], parts["value_scales"]
        open_slot, value_group = cache.open_slot, head_dim // value_mins.shape[-1]
    else:
        bits, value_group = 0, head_dim
        keys, values = cache.keys[layer], cache.values[layer]
        k_codes = v_codes = key_mins = key_scales = value_mins = value_scales = open_slot = keys  # unread
    shape = launch_shape(decode, group, head_dim, bits, upcast)
    max_context = tables.block_tables.shape[1] * cache.block_size  # from shapes alone: fixed for a graph bucket
    splits = 1
    if decode:
        splits = tables.num_splits or decode_splits(num_seqs, cache.num_kv_heads, max_context)
    partition = max_context
    if splits > 1:
        partition = triton.cdiv(triton.cdiv(max_context, splits), shape.block_n) * shape.block_n
    part_stats = part_acc = out  # unread without a split
    if splits > 1:
        part_stats = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(num_seqs, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
    grid = (num_seqs, cache.num_kv_heads, splits if decode else triton.cdiv(tables.max_query_len, shape.block_q))
    _paged_attention[grid](
        q, out, keys, values, tables.block_tables, tables.query_starts, tables.context_lens,
        open_slot, key_mins, key_scales, value_mins, value_scales,
        tables.scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        keys.stride(0), keys.stride(1), keys.stride(2),
        k_codes.stride(0), k_codes.stride(1), k_codes.stride(2),
        key_mins.stride(0), key_mins.stride(2),
        value_mins.stride(0), value_mins.stride(1), value_mins.stride(2),
        tables.block_tables.stride(0), tables.context_lens.stride(0),
        k_codes, v_codes,
        part_stats, part_acc, num_heads, splits, partition,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=shape.block_d, BLOCK_SIZE=cache.block_size,
        BLOCK_Q=shape.block_q, BLOCK_M=shape.block_m, BLOCK_N=shape.block_n,
        BITS=bits, VALUE_GROUP=value_group, UPCAST=upcast, PRECISION="ieee" if upcast else None, SPLIT=splits > 1,
        num_warps=shape.num_warps,
    )
    if splits > 1:
        _combine_splits[(num_seqs, num_heads)](
            part_stats, part_acc, out, tables.query_starts, num_heads, splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=shape.block_d, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        )
    return out.view(tokens, num_heads * head_dim)
