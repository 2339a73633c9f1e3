"""Attention over the paged KV cache, read through block tables, one length class of sequences at a time.

New tokens are written to their slots first; then every query attends to its sequence's blocks. A group's
sequences are split into length classes by the blocks their context needs (1, 2, 3-4, 5-8, ... blocks: a
class's widest context is under twice its narrowest), and each class reads just its own sequences' blocks
(`KVCache.read_blocks`) and attends in one fused `scaled_dot_product_attention` call. So the work and the
memory of a step follow each sequence's own context length: a long sequence among short ones reads its
blocks alone, and no short one is padded to it (before, every sequence of a step was padded to the
longest: one 16k-token response among 255 short ones needed a workspace of 256 x 16k tokens per layer).
When every context falls in one class (the common case in RL) the step is one call, as before.

A step's sequences also attend apart by query length: those with one new token (decode) in one group,
those with several (prefill) in another, so a prefill mixed into a decode step does not pad every decode
row to its query length.

A kernel can attend instead (EngineConfig.attention_backend): the Triton kernel (rollout/model/attention_triton.py,
the default on CUDA: any dtype, quantized caches too) or FlashInfer's (rollout/model/attention_flashinfer.py). Both
read every sequence's blocks in place through its block table; the metadata then carries the planned kernel and no
length classes. A CUDA-graph decode (rollout/engine/cuda_graphs.py) needs attention over fixed shapes: the Triton
kernel on CUDA; on CPU, where its "replay" is a plain call, `attend_fixed` below.
"""

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from rollout.kv.cache import KVCache


class PagedKernel(Protocol):
    """A kernel planned for one forward pass (or one CUDA-graph bucket) that reads the cache's blocks in place."""

    def attend(self, q: torch.Tensor, layer: int, cache: KVCache) -> torch.Tensor:
        """q: [T, Hq, D] of the planned rows. Returns [T, Hq * D]."""


@dataclass
class Observation:
    """Rows of a length class whose attention is reported (for score-based KV eviction, rollout/engine/kv_eviction.py):
    the attention probabilities of their latest queries, averaged with `query_weights` over queries and over
    the query heads of each kv head, per layer: metadata.observations[seq_id][layer] is [kv_heads, slots]."""

    rows: torch.Tensor  # [n] rows within the class
    seq_ids: list[int]
    query_weights: torch.Tensor  # [n, max_query_len], summing to 1 over each row's observed queries


@dataclass
class LengthClass:
    """The group's sequences `rows`, each reading its first `num_blocks` blocks (its context, padded with
    block 0 up to the class's widest)."""

    rows: torch.Tensor | None  # [n] indices into the group's sequences; None: all of them, in order
    block_ids: torch.Tensor  # [n * num_blocks] their blocks, row by row
    num_blocks: int
    mask: torch.Tensor  # [n, 1, max_query_len, num_blocks * block_size], additive: 0 attend, -inf not
    observed: Observation | None = None


@dataclass
class AttentionGroup:
    """Sequences that attend together, their queries padded to the longest query among them.

    Their new tokens are the contiguous rows `rows` of the batch's flat [T, ...] tokens; attention runs
    padded, one row per sequence: queries [B, heads, max_query_len, head_dim] against each context.
    """

    rows: slice  # the group's new tokens in the flat batch
    num_seqs: int
    classes: list[LengthClass]
    query_slots: torch.Tensor | None  # [T] row of each new token in the padded [B * max_query_len]; None = one per sequence
    max_query_len: int


@dataclass
class AttentionMetadata:
    """Index tensors of one forward pass, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup]
    observations: dict[int, list[torch.Tensor]] = field(default_factory=dict)  # see Observation
    kernel: PagedKernel | None = None  # planned for this pass: it attends instead of `groups`


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layer: int,
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] of the new tokens. Returns [T, Hq * D]."""
    cache.write(layer, meta.slot_mapping, k, v)
    return attend(q, layer, cache, meta, scale)


def attend(q: torch.Tensor, layer: int, cache: KVCache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Attention of q ([T, Hq, D]) over the cache as it is (the new tokens' KV already written)."""
    if meta.kernel is not None:
        return meta.kernel.attend(q, layer, cache)
    if len(meta.groups) == 1:
        return _attend(q, layer, cache, meta.groups[0], scale, meta.observations)
    return torch.cat([_attend(q[group.rows], layer, cache, group, scale, meta.observations) for group in meta.groups])


def _attend(q: torch.Tensor, layer: int, cache: KVCache, group: AttentionGroup, scale: float,
            observations: dict[int, list[torch.Tensor]]) -> torch.Tensor:
    _, num_heads, head_dim = q.shape
    batch, query_len = group.num_seqs, group.max_query_len
    if group.query_slots is None:
        queries = q.view(batch, 1, num_heads, head_dim)
    else:
        padded = q.new_zeros(batch * query_len, num_heads, head_dim)
        padded.index_copy_(0, group.query_slots, q)
        queries = padded.view(batch, query_len, num_heads, head_dim)
    queries = queries.transpose(1, 2)  # [B, Hq, Lq, D]
    if len(group.classes) == 1 and group.classes[0].rows is None:
        out = _attend_class(queries, layer, cache, group.classes[0], scale, observations)
    else:
        out = torch.empty_like(queries)
        for length_class in group.classes:
            rows = length_class.rows
            out.index_copy_(0, rows, _attend_class(queries.index_select(0, rows), layer, cache, length_class, scale,
                                                   observations))
    out = out.transpose(1, 2).reshape(batch * query_len, num_heads * head_dim)
    return out if group.query_slots is None else out.index_select(0, group.query_slots)


def _attend_class(queries: torch.Tensor, layer: int, cache: KVCache, length_class: LengthClass,
                  scale: float, observations: dict[int, list[torch.Tensor]]) -> torch.Tensor:
    keys, values = cache.read_blocks(layer, length_class.block_ids)
    shape = (queries.shape[0], length_class.num_blocks * cache.block_size, cache.num_kv_heads, cache.head_dim)
    keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
    if length_class.observed is not None:
        _observe(queries, keys, length_class, scale, observations)
    return F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=length_class.mask, scale=scale, enable_gqa=queries.shape[1] != keys.shape[1]
    )


def _observe(queries: torch.Tensor, keys: torch.Tensor, length_class: LengthClass, scale: float,
             observations: dict[int, list[torch.Tensor]]) -> None:
    """Append each observed row's attention of this layer, [kv_heads, slots], to observations[seq_id]."""
    seen = length_class.observed
    q = queries.index_select(0, seen.rows).float()  # [n, Hq, Lq, D]
    k = keys.index_select(0, seen.rows).float()  # [n, Hkv, T, D]
    n, num_heads, query_len, head_dim = q.shape
    kv_heads = k.shape[1]
    scores = torch.matmul(q.reshape(n, kv_heads, -1, head_dim), k.transpose(-1, -2)) * scale
    scores = scores.view(n, kv_heads, num_heads // kv_heads, query_len, -1)
    scores = scores + length_class.mask.index_select(0, seen.rows).float().unsqueeze(1)
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # padded query rows may see nothing
    weighted = (probs * seen.query_weights.view(n, 1, 1, query_len, 1)).sum(dim=3).mean(dim=2)
    for seq_id, row in zip(seen.seq_ids, weighted):
        observations.setdefault(seq_id, []).append(row)


@dataclass
class FixedShapeAttention:
    """Decode attention over fixed shapes in plain torch: every row reads all `block_tables` columns ([B, W]) and
    masks the slots past its context length. What a CUDA-graph bucket runs on CPU, where a "replay" is a plain call
    (rollout/engine/cuda_graphs.py); it pads every row to W blocks, so it is for tests, not speed."""

    block_tables: torch.Tensor  # [B, W] int64
    context_lens: torch.Tensor  # [B]
    scale: float

    def attend(self, q: torch.Tensor, layer: int, cache: KVCache) -> torch.Tensor:
        batch, num_heads, head_dim = q.shape
        width = self.block_tables.shape[1] * cache.block_size
        keys, values = cache.read_blocks(layer, self.block_tables.reshape(-1))
        shape = (batch, width, cache.num_kv_heads, head_dim)
        keys, values = keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)
        visible = torch.arange(width, device=q.device) < self.context_lens.unsqueeze(1)  # [B, width]
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=visible[:, None, None, :],
                                             scale=self.scale, enable_gqa=num_heads != cache.num_kv_heads)
        return out.reshape(batch, num_heads * head_dim)
