"""Paged attention on GPU through FlashInfer's BatchPrefillWithPagedKVCacheWrapper, behind attention.paged_attention.

The native cache's per-layer tensors are already FlashInfer's "NHD" paged layout (keys and values each
[num_blocks, block_size, kv_heads, head_dim]), so the kernel reads each sequence's blocks in place through its
block table: no gather into a workspace, no padding of queries or contexts. One plan per forward pass (the
step's block tables, query lengths and context lengths, built on the host) serves every layer. Decodes (one
query each) and prefill chunks go in one call: with `causal`, FlashInfer aligns a sequence's queries with the
end of its context, which is where the new tokens sit (their slots were written before attention runs).

`EngineConfig.attention_backend` chooses it ('auto' takes it on CUDA for a float16/bfloat16 cache in the model
dtype, head_dim 64/128/256, when flashinfer is installed). FlashInfer has no float32 kernels and cannot read the quantized cache, so
those engines stay on the torch path; so does a step that reports attention scores (snapkv eviction).
flash-attn's paged kernel was not used: flash_attn_with_kvcache needs blocks of a multiple of 256 tokens.
"""

import itertools
from collections.abc import Sequence

import torch

from rollout.kv.cache import KVCache

WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (its examples' size)
class FlashInferAttention:
    """One wrapper and workspace per engine: `plan` once per forward pass, then `attend` in every layer."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        import flashinfer

        self.device = device
        self.block_size = block_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5  # the model's attention scale (rollout/model/decoder.py), fixed by the plan
        self.dtype = dtype
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def plan(self, block_tables: Sequence[Sequence[int]], query_lens: Sequence[int], kv_lens: Sequence[int]) -> None:
        """The step's sequences in the order of its flat query rows: each has query_lens[i] new tokens, the last of
        its kv_lens[i] cache slots, in the blocks of block_tables[i]."""
        pages = [-(-n // self.block_size) for n in kv_lens]
        indices = [block for table, n in zip(block_tables, pages, strict=True) for block in table[:n]]
        self._wrapper.plan(
            torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32),
            torch.tensor([0, *itertools.accumulate(pages)], dtype=torch.int32),
            torch.tensor(indices, dtype=torch.int32, device=self.device),
            torch.tensor([n - (p - 1) * self.block_size for n, p in zip(kv_lens, pages)], dtype=torch.int32),
            self.num_heads, self.num_kv_heads, self.head_dim, self.block_size,
            causal=True, sm_scale=self.scale, q_data_type=self.dtype, kv_data_type=self.dtype,
        )

    def attend(self, q: torch.Tensor, layer: int, cache: KVCache) -> torch.Tensor:
        """q: [T, Hq, D] of the planned rows. Returns [T, Hq * D]."""
        return self._wrapper.run(q.contiguous(), (cache.keys[layer], cache.values[layer])).reshape(q.shape[0], -1)
