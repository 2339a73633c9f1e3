"""A paged KV cache that stores blocks quantized (int8 / int4, KIVI-style) and dequantizes them when attention reads.

Same interface as rollout/kv/cache.py's KVCache, and the same codec as KV on the wire (rollout/kv/codecs.py's
`Quantized`): a block is encoded as one [block_size tokens] group of keys per channel (per head) and values per token
over groups of channels, so the wire and the resident cache are one interface.

Keys per channel need every token of their group, and decode writes a block's tokens one step at a time. So a block
being filled stays in the model dtype in a small pool of open blocks (KIVI's full-precision residual) and is quantized
when its last slot is written; a write that brings a whole block (prefill) quantizes it at once. read_blocks
dequantizes the blocks asked for, and only those, straight into its workspace in the model dtype (no float32 copy),
and takes the open ones from the pool.

Nothing in a step reads the device from the host: the model runner hands the cache the host list of the step's
slots with the slot tensor (`plan_write`), the write is planned from that list, its index tensors go to the device
in one non-blocking copy, and reads pick open blocks from the pool on the device.

The cache is not told when the block manager frees a block, so the pool is kept by recency: when it is full, the
least recently written open block is closed as it is (quantized with its unwritten slots padded by its last written
token, so they do not widen its key ranges), and a later write into it (at an offset > 0) reopens it by dequantizing.
A block freed while open (a finished sequence's last block) is reclaimed that way. A write that needs more open
blocks than the pool holds (a large compute_logprobs prefill) uses extra slots that are closed when it ends.
"""

from dataclasses import dataclass

import torch

from rollout.kv.cache import device_ids
from rollout.kv.codecs import EncodedKV, Quantized

_BITS = {"int8": 8, "int4": 4}


def block_codec(kv_cache_dtype: str, block_size: int) -> Quantized:
    """The codec of one resident block of `kv_cache_dtype` ("int8" or "int4"): a key group is the block's tokens."""
    if kv_cache_dtype not in _BITS:
        raise ValueError(f"kv_cache_dtype: a quantized cache is one of {sorted(_BITS)}, got {kv_cache_dtype!r}")
    return Quantized(_BITS[kv_cache_dtype], key_group_size=block_size)


@dataclass
class _WritePlan:
    """What one forward pass's write does to the cache, worked out at layer 0 and applied in every layer."""

    whole_ids: torch.Tensor | None  # blocks the write fills entirely: quantized straight from it
    whole_rows: torch.Tensor | None  # their rows of the write, block by block in slot order
    pool_rows: torch.Tensor | None  # rows written into open blocks
    pool_positions: torch.Tensor | None  # their rows in the pool, slot * block_size + offset
    closing: list[tuple[int, int]]  # (block, pool slot) quantized after the write: filled, or in an extra slot
    closing_ids: torch.Tensor | None
    closing_slots: torch.Tensor | None


class QuantizedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, codec: Quantized, num_open_blocks: int):
        if num_open_blocks <= 0:
            raise ValueError(f"num_open_blocks: must be > 0, got {num_open_blocks}")
        self.codec = codec
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.num_open_blocks = num_open_blocks
        layout = codec.part_layout((num_blocks, block_size, num_kv_heads, head_dim), dtype)
        # Zeros: a block never written decodes to zeros, never to NaN (see KVCache).
        self.parts = {name: torch.zeros((num_layers, *shape), dtype=part_dtype, device=device)
                      for name, (shape, part_dtype) in layout.items()}
        pool_shape = (num_layers, num_open_blocks, block_size, num_kv_heads, head_dim)
        self.open_keys = torch.zeros(pool_shape, dtype=dtype, device=device)
        self.open_values = torch.zeros(pool_shape, dtype=dtype, device=device)
        self.open_slot = torch.full((num_blocks,), -1, dtype=torch.int64, device=device)  # block -> pool slot
        self._slot_of: dict[int, int] = {}
        self._block_in: list[int | None] = [None] * num_open_blocks
        self._last_write = [0] * num_open_blocks
        self._filled = [0] * num_blocks  # tokens written into each block: its highest written offset + 1
        self._tick = 0
        self._plan: _WritePlan | None = None
        self._planned: tuple[torch.Tensor, list[int]] | None = None  # plan_write's (slot_mapping, its host list)
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_blocks(self) -> int:
        return self.open_slot.numel()

    @property
    def num_open(self) -> int:
        """Blocks held in the float pool now."""
        return len(self._slot_of)

    def plan_write(self, slots: list[int], slot_mapping: torch.Tensor) -> None:
        """`slot_mapping`, which the next forward pass writes, holds `slots`: its write is planned from this host list
        (without it, write reads slot_mapping back from the device: a host sync)."""
        self._planned = (slot_mapping, slots)

    def write(self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([T, num_kv_heads, head_dim]) at token slots `slot_mapping` ([T]); layers are written in order."""
        if layer == 0:
            planned, self._planned = self._planned, None
            slots = planned[1] if planned is not None and planned[0] is slot_mapping else slot_mapping.tolist()
            self._plan = self._plan_write(slots)
        plan = self._plan
        if plan.pool_rows is not None:
            rows = (-1, self.num_kv_heads, self.head_dim)
            self.open_keys[layer].view(rows).index_copy_(0, plan.pool_positions, k.index_select(0, plan.pool_rows))
            self.open_values[layer].view(rows).index_copy_(0, plan.pool_positions, v.index_select(0, plan.pool_rows))
        if plan.whole_ids is not None:
            blocks = (-1, self.block_size, self.num_kv_heads, self.head_dim)
            self._store(layer, plan.whole_ids, k.index_select(0, plan.whole_rows).view(blocks),
                        v.index_select(0, plan.whole_rows).view(blocks))
        if plan.closing:
            self._store(layer, plan.closing_ids, *self._padded_open(layer, plan.closing))
        if layer == self.num_layers - 1:
            for block, _ in plan.closing:
                self._free_slot(block)
            self._shrink_pool()
            self._plan = None

    def read_blocks(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given blocks of one layer, each [len(block_ids), block_size, heads, head_dim] in the
        model dtype, in a workspace reused by every read (valid until the next one), as KVCache.read_blocks."""
        count = block_ids.numel()
        if self._workspace is None or self._workspace[0].shape[0] < count:
            shape = (count, self.block_size, self.num_kv_heads, self.head_dim)
            self._workspace = (torch.empty(shape, dtype=self.dtype, device=self.device),
                               torch.empty(shape, dtype=self.dtype, device=self.device))
        k_out, v_out = (buf[:count] for buf in self._workspace)
        self._load(layer, block_ids, (k_out, v_out))
        self._overlay_open(layer, block_ids, k_out, v_out)
        return k_out, v_out

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks src[i] -> dst[i] in every layer (an open block's copy is open too)."""
        src_ids, dst_ids = self._ids(src, dst)
        for part in self.parts.values():
            part[:, dst_ids] = part[:, src_ids]
        for target in dst:
            if target in self._slot_of:
                self._free_slot(target)
        busy = {self._slot_of[s] for s in src if s in self._slot_of}
        for source, target in zip(src, dst):
            self._filled[target] = self._filled[source]
            if source in self._slot_of:
                slot = self._open(target, busy, reopen=False)
                busy.add(slot)
                self.open_keys[:, slot] = self.open_keys[:, self._slot_of[source]]
                self.open_values[:, slot] = self.open_values[:, self._slot_of[source]]
        self._shrink_pool()

    def export_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized copies of the given blocks, each [num_layers, len(block_ids), block_size, heads, head_dim]."""
        ids = torch.tensor(block_ids, device=self.device)
        keys, values = [], []
        for layer in range(self.num_layers):  # not through read_blocks: its workspace may be an inference tensor
            k, v = self._load(layer, ids)
            self._overlay_open(layer, ids, k, v)
            keys.append(k)
            values.append(v)
        return torch.stack(keys), torch.stack(values)

    def import_blocks(self, block_ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Overwrite the given blocks with tensors shaped like export_blocks' output; each is quantized whole (a
        partly filled last block is reopened by the write of its next token)."""
        for block in block_ids:
            if block in self._slot_of:
                self._free_slot(block)
            self._filled[block] = self.block_size
        ids = torch.tensor(block_ids, device=self.device)
        for layer in range(self.num_layers):
            self._store(layer, ids, keys[layer].to(self.dtype), values[layer].to(self.dtype))

    # ------------------------------------------------------------------ internals

    def _overlay_open(self, layer: int, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Replace the rows of keys, values ([len(block_ids), ...]) whose block is open by the pool's float copy: chosen
        on the device (which rows are open is not known on the host without a sync)."""
        if not self._slot_of:
            return
        slots = self.open_slot.index_select(0, block_ids)
        is_open = (slots >= 0).view(-1, 1, 1, 1)
        slots = slots.clamp_(min=0)
        torch.where(is_open, self.open_keys[layer].index_select(0, slots), keys, out=keys)
        torch.where(is_open, self.open_values[layer].index_select(0, slots), values, out=values)

    def _plan_write(self, slots: list[int]) -> _WritePlan:
        self._tick += 1
        block_size = self.block_size
        entries: dict[int, list[tuple[int, int]]] = {}  # block -> (offset, row) of the rows written into it
        for row, slot in enumerate(slots):
            entries.setdefault(slot // block_size, []).append((slot % block_size, row))
        whole_ids, whole_rows, partial = [], [], {}
        for block, written in entries.items():
            if len(written) == block_size:
                whole_ids.append(block)
                whole_rows += [row for _, row in sorted(written)]
                if block in self._slot_of:  # its float copy is overwritten whole
                    self._free_slot(block)
                self._filled[block] = block_size
            else:
                partial[block] = written
        pool_rows, pool_positions, closing = [], [], []
        busy = {self._slot_of[block] for block in partial if block in self._slot_of}
        for block, written in partial.items():
            first = min(offset for offset, _ in written)
            last = max(offset for offset, _ in written)
            slot = self._slot_of.get(block)
            if slot is None:  # written from offset 0: a fresh block; else one closed before it was full
                slot = self._open(block, busy, reopen=first > 0)
                busy.add(slot)
            self._filled[block] = last + 1 if first == 0 else max(self._filled[block], last + 1)
            self._last_write[slot] = self._tick
            pool_rows += [row for _, row in written]
            pool_positions += [slot * block_size + offset for offset, _ in written]
            if last == block_size - 1 or slot >= self.num_open_blocks:
                closing.append((block, slot))
        whole_ids, whole_rows, pool_rows, pool_positions, closing_ids, closing_slots = self._ids(
            whole_ids, whole_rows, pool_rows, pool_positions, [block for block, _ in closing], [s for _, s in closing])
        return _WritePlan(whole_ids=whole_ids, whole_rows=whole_rows, pool_rows=pool_rows,
                          pool_positions=pool_positions, closing=closing, closing_ids=closing_ids,
                          closing_slots=closing_slots)

    def _open(self, block: int, busy: set[int], reopen: bool) -> int:
        """A pool slot for `block`: a free one, else the least recently written one not in `busy` (closed first),
        else a new extra slot. reopen: fill it with the block's dequantized contents."""
        slot = next((s for s, held in enumerate(self._block_in) if held is None), None)
        if slot is None:
            candidates = [s for s in range(self.num_open_blocks) if s not in busy]
            if candidates:
                slot = min(candidates, key=self._last_write.__getitem__)
                self._close_now(self._block_in[slot])
            else:
                slot = self._grow_pool()
        self._slot_of[block] = slot
        self._block_in[slot] = block
        self.open_slot[block] = slot
        if reopen:
            (ids,) = self._ids([block])
            for layer in range(self.num_layers):
                keys, values = self._load(layer, ids)
                self.open_keys[layer, slot] = keys[0]
                self.open_values[layer, slot] = values[0]
        return slot

    def _close_now(self, block: int) -> None:
        """Quantize an open block as it is, in every layer, and free its slot."""
        closing = [(block, self._slot_of[block])]
        (ids,) = self._ids([block])
        for layer in range(self.num_layers):
            self._store(layer, ids, *self._padded_open(layer, closing))
        self._free_slot(block)

    def _free_slot(self, block: int) -> None:
        slot = self._slot_of.pop(block)
        self._block_in[slot] = None
        self.open_slot[block] = -1

    @torch.inference_mode(False)  # the pool must stay a normal tensor: the KV hand-off copies blocks outside it
    def _grow_pool(self) -> int:
        """Append extra pool slots (doubling); returns the first new one. _shrink_pool removes them."""
        old = len(self._block_in)
        extra = old
        pad = (self.num_layers, extra, self.block_size, self.num_kv_heads, self.head_dim)
        self.open_keys = torch.cat([self.open_keys, self.open_keys.new_zeros(pad)], dim=1)
        self.open_values = torch.cat([self.open_values, self.open_values.new_zeros(pad)], dim=1)
        self._block_in += [None] * extra
        self._last_write += [0] * extra
        return old

    @torch.inference_mode(False)
    def _shrink_pool(self) -> None:
        """Close the blocks in extra slots and drop those slots."""
        if len(self._block_in) == self.num_open_blocks:
            return
        for block in self._block_in[self.num_open_blocks:]:
            if block is not None:
                self._close_now(block)
        self.open_keys = self.open_keys[:, : self.num_open_blocks].clone()
        self.open_values = self.open_values[:, : self.num_open_blocks].clone()
        del self._block_in[self.num_open_blocks:]
        del self._last_write[self.num_open_blocks:]

    def _padded_open(self, layer: int, closing: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the open blocks `closing` ((block, slot) pairs) of one layer; the slots of a partly
        filled block past its last written token repeat that token, so they do not change its quantization ranges."""
        (slots,) = self._ids([slot for _, slot in closing])
        keys = self.open_keys[layer].index_select(0, slots)
        values = self.open_values[layer].index_select(0, slots)
        for i, (block, _) in enumerate(closing):
            filled = self._filled[block]
            if 0 < filled < self.block_size:
                keys[i, filled:] = keys[i, filled - 1]
                values[i, filled:] = values[i, filled - 1]
        return keys, values

    def _store(self, layer: int, block_ids: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Quantize keys, values ([n, block_size, heads, head_dim]) into blocks `block_ids` of one layer."""
        encoded = self.codec.encode(keys, values)  # n blocks encode as n "layers" of block_size tokens
        for name, part in encoded.parts.items():
            self.parts[name][layer].index_copy_(0, block_ids, part)

    def _load(self, layer: int, block_ids: torch.Tensor,
              out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized keys and values of blocks `block_ids` of one layer, each [n, block_size, heads, head_dim] in the
        model dtype, into `out` when given: only those blocks' codes and parameters are read."""
        shape = (block_ids.numel(), self.block_size, self.num_kv_heads, self.head_dim)
        if out is None:
            out = (torch.empty(shape, dtype=self.dtype, device=self.device),
                   torch.empty(shape, dtype=self.dtype, device=self.device))
        parts = {name: part[layer].index_select(0, block_ids) for name, part in self.parts.items()}
        self.codec.decode_into(EncodedKV(self.codec.name, shape, self.dtype, parts), *out)
        return out

    def _ids(self, *lists: list[int]) -> list[torch.Tensor | None]:
        return device_ids(self.device, *lists)
