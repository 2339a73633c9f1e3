"""Attention over the paged KV cache: new tokens are written to their slots, then every query
attends to its sequence's blocks, gathered through the block table."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rollout.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    """Index tensors of one forward pass, shared by every layer.

    The T new tokens of the batch are flat ([T, ...]); attention runs padded, one row per
    sequence: queries [B, heads, max_query_len, head_dim] against each sequence's context.
    """

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] block ids, padded with 0 (masked out)
    mask: torch.Tensor  # [B, 1, max_query_len, max_blocks * block_size], additive: 0 attend, -inf not
    query_slots: torch.Tensor | None  # [T] row of each new token in the padded [B * max_query_len]; None = one per sequence
    max_query_len: int


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
    _, num_heads, head_dim = q.shape
    cache.write(layer, meta.slot_mapping, k, v)
    keys, values = cache.gather(layer, meta.block_tables)
    batch = meta.block_tables.shape[0]
    if meta.query_slots is None:
        queries = q.view(batch, 1, num_heads, head_dim)
    else:
        padded = q.new_zeros(batch * meta.max_query_len, num_heads, head_dim)
        padded.index_copy_(0, meta.query_slots, q)
        queries = padded.view(batch, meta.max_query_len, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys,
        values,
        attn_mask=meta.mask,
        scale=scale,
        enable_gqa=num_heads != keys.shape[1],
    )
    out = out.transpose(1, 2).reshape(batch * meta.max_query_len, num_heads * head_dim)
    return out if meta.query_slots is None else out.index_select(0, meta.query_slots)
