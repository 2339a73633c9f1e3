"""Attention over the paged KV cache: new tokens are written to their slots, then every query
attends to its sequence's blocks, gathered through the block table.

A step's sequences attend in groups: those with one new token (decode) apart from those with several
(prefill), so that a prefill mixed into a decode step does not pad every decode row to its query length.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout.kv_cache import KVCache


@dataclass
class AttentionGroup:
    """Sequences that attend together, padded to the longest query among them.

    Their new tokens are the contiguous rows `rows` of the batch's flat [T, ...] tokens; attention runs
    padded, one row per sequence: queries [B, heads, max_query_len, head_dim] against each context.
    """

    rows: slice  # the group's new tokens in the flat batch
    block_tables: torch.Tensor  # [B, max_blocks] block ids, padded with 0 (masked out)
    mask: torch.Tensor  # [B, 1, max_query_len, max_blocks * block_size], additive: 0 attend, -inf not
    query_slots: torch.Tensor | None  # [T] row of each new token in the padded [B * max_query_len]; None = one per sequence
    max_query_len: int


@dataclass
class AttentionMetadata:
    """Index tensors of one forward pass, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    groups: list[AttentionGroup]


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
    if len(meta.groups) == 1:
        return _attend(q, layer, cache, meta.groups[0], scale)
    return torch.cat([_attend(q[group.rows], layer, cache, group, scale) for group in meta.groups])


def _attend(q: torch.Tensor, layer: int, cache: KVCache, group: AttentionGroup, scale: float) -> torch.Tensor:
    _, num_heads, head_dim = q.shape
    keys, values = cache.gather(layer, group.block_tables)
    batch = group.block_tables.shape[0]
    if group.query_slots is None:
        queries = q.view(batch, 1, num_heads, head_dim)
    else:
        padded = q.new_zeros(batch * group.max_query_len, num_heads, head_dim)
        padded.index_copy_(0, group.query_slots, q)
        queries = padded.view(batch, group.max_query_len, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys,
        values,
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=num_heads != keys.shape[1],
    )
    out = out.transpose(1, 2).reshape(batch * group.max_query_len, num_heads * head_dim)
    return out if group.query_slots is None else out.index_select(0, group.query_slots)
