"""Paged KV storage: fixed-size blocks addressed by block id, read through block tables.

Keys and values of layer l live in `keys[l]` / `values[l]`, shaped
[num_blocks, block_size, num_kv_heads, head_dim]; token slot s is block s // block_size,
offset s % block_size. Blocks can be copied (copy-on-write of shared prompt blocks) and exported /
imported as whole tensors (the hook for shipping KV between prefill and decode workers).
"""

import torch


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, copied without making the host wait for the device: built in pinned memory
    on an accelerator and copied with non_blocking (a copy from pageable memory waits for all the work queued before
    it). Every host-made tensor of an engine step comes through here (tests/test_engine_host_sync.py)."""
    pinned = device.type not in ("cpu", "meta")
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=True)


def device_ids(device: torch.device, *lists: list[int]) -> list[torch.Tensor | None]:
    """Each list as an int64 tensor on `device` (None when empty), all in one copy of to_device."""
    flat = [value for values in lists for value in values]
    if not flat:
        return [None] * len(lists)
    on_device = to_device(flat, torch.int64, device)
    out, start = [], 0
    for values in lists:
        out.append(on_device[start : start + len(values)] if values else None)
        start += len(values)
    return out


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
        self.num_layers = num_layers
        self.device = device
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None
        # Per-layer views with one row per token slot, [num_blocks * block_size, heads, head_dim].
        self._slot_keys = [layer.view(-1, num_kv_heads, head_dim) for layer in self.keys]
        self._slot_values = [layer.view(-1, num_kv_heads, head_dim) for layer in self.values]

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[1]

    def plan_write(self, slots: list[int], slot_mapping: torch.Tensor) -> None:
        """Nothing to plan: write indexes by the slot tensor alone (QuantizedKVCache plans from the host list)."""

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, num_kv_heads, head_dim]) at token slots `slot_mapping` ([T])."""
        self._slot_keys[layer].index_copy_(0, slot_mapping, k)
        self._slot_values[layer].index_copy_(0, slot_mapping, v)

    def read_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given blocks of one layer, each [len(block_ids), block_size, heads, head_dim].

        The result lives in a workspace reused by every layer and step (valid until the next read): a fresh
        multi-megabyte tensor per layer costs as much in page faults as the copy itself. Attention reads one
        length class of sequences at a time (rollout/model/attention.py), so it holds that class's contexts, not
        every sequence padded to the longest.
        """
        count = block_ids.numel()
        if self._workspace is None or self._workspace[0].shape[0] < count:
            shape = (count, *self.keys.shape[2:])
            self._workspace = (self.keys.new_empty(shape), self.values.new_empty(shape))
        k_out, v_out = (buf[:count] for buf in self._workspace)
        torch.index_select(self.keys[layer], 0, block_ids, out=k_out)
        torch.index_select(self.values[layer], 0, block_ids, out=v_out)
        return k_out, v_out

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer."""
        src_ids, dst_ids = device_ids(self.keys.device, src, dst)
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
