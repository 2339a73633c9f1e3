"""Paged KV storage: fixed-size blocks addressed by block id, read through block tables.

Keys and values of layer l live in `keys[l]` / `values[l]`, shaped
[num_blocks, block_size, num_kv_heads, head_dim]; token slot s is block s // block_size,
offset s % block_size. Blocks can be copied (copy-on-write of shared prompt blocks) and exported /
imported as whole tensors (the hook for shipping KV between prefill and decode workers).
"""

import torch


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: masked-out slots still enter softmax(scores) @ V as 0 * value, and a
        # NaN from uninitialised memory would survive that product.
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[1]

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, num_kv_heads, head_dim]) at token slots `slot_mapping` ([T])."""
        flat = (-1, self.num_kv_heads, self.head_dim)
        self.keys[layer].view(flat).index_copy_(0, slot_mapping, k)
        self.values[layer].view(flat).index_copy_(0, slot_mapping, v)

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of each sequence's blocks, [B, num_kv_heads, blocks * block_size, head_dim]."""
        batch, width = block_tables.shape
        shape = (batch, width * self.block_size, self.num_kv_heads, self.head_dim)
        ids = block_tables.reshape(-1)
        k = self.keys[layer].index_select(0, ids).view(shape).transpose(1, 2)
        v = self.values[layer].index_select(0, ids).view(shape).transpose(1, 2)
        return k, v

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer."""
        src_ids = torch.tensor(src, device=self.keys.device)
        dst_ids = torch.tensor(dst, device=self.keys.device)
        self.keys[:, dst_ids] = self.keys[:, src_ids]
        self.values[:, dst_ids] = self.values[:, src_ids]

    def export_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the given blocks, each [num_layers, len(block_ids), block_size, heads, head_dim]."""
        ids = torch.tensor(block_ids, device=self.keys.device)
        return self.keys[:, ids].clone(), self.values[:, ids].clone()

    def import_blocks(self, block_ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the given blocks with tensors shaped like export_blocks' output."""
        ids = torch.tensor(block_ids, device=self.keys.device)
        self.keys[:, ids] = keys.to(self.keys)
        self.values[:, ids] = values.to(self.values)
