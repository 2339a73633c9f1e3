"""The second KV tier: idle sessions' KV kept in host memory, under a byte budget, instead of recomputed.

When the cache runs short, an idle session's blocks leave it (rollout/engine/sessions.py: evict_idle). With a tier
their KV is first copied out: the first `num_tokens` token slots of its blocks, every layer, as the `codec` encodes
them (rollout/kv/codecs.py: `none` keeps plain copies, bit-exact; `int8` / `int4` quantize them to 1 byte / half a
byte a value plus float16 group parameters, with codecs.py's error bound). At the session's next turn the KV comes back
into fresh blocks by copy (and dequantization) instead of a prefill over its whole context.

A full tier makes room by dropping entries (those sessions recompute, as without a tier): the oldest first, or as
the caller's `drop_first` chooses (engine.session_policy kv_aware: the session expected back last, which may be the
newcomer: then it is not kept). An entry larger than the whole budget is not kept. Entries live on the CPU whatever the cache's device.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rollout.kv.codecs import EncodedKV, make_codec

TIER_STATS = ("session_tier_puts", "session_tier_hits", "session_tier_dropped", "session_tier_bytes_out",
              "session_tier_bytes_in", "session_tier_bytes", "session_tier_tokens_restored")


@dataclass(frozen=True)
class TierEntry:
    encoded: EncodedKV  # the KV of the context's first num_tokens tokens
    num_tokens: int
    kv_version: int | None  # the weight version the KV was computed with (Sequence.context_version)

    @property
    def nbytes(self) -> int:
        return self.encoded.nbytes


class HostKVTier:
    """session id -> its KV in host memory; `cache` is the engine's KVCache or QuantizedKVCache (export_blocks /
    import_blocks)."""

    def __init__(self, cache, budget_bytes: int, codec: str, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype):
        self.cache = cache
        self.budget_bytes = budget_bytes
        self.codec = make_codec(codec)
        self.block_size = block_size
        self.layout = (num_layers, num_kv_heads, head_dim)
        self.dtype = dtype
        self.entries: OrderedDict[str, TierEntry] = OrderedDict()  # oldest first
        self.pinned: set[str] = set()  # entries never dropped for room (a turn is bringing them back)
        self.bytes_used = 0
        self.num_puts = 0  # sessions whose KV went into the tier
        self.num_hits = 0  # sessions whose KV came back from it
        self.num_dropped = 0  # entries dropped to make room (their sessions recompute)
        self.bytes_out = 0  # bytes copied into the tier (encoded)
        self.bytes_in = 0  # bytes copied back from it (encoded)
        self.tokens_restored = 0  # tokens whose KV came back instead of being recomputed

    def nbytes_for(self, num_tokens: int) -> int:
        """What the KV of `num_tokens` tokens takes in the tier."""
        layers, heads, head_dim = self.layout
        return self.codec.encoded_nbytes((layers, num_tokens, heads, head_dim), self.dtype)

    @property
    def capacity_blocks(self) -> int:
        """Full blocks of KV the whole budget holds."""
        return self.budget_bytes // self.nbytes_for(self.block_size)

    def put(self, session_id: str, block_ids: list[int], num_tokens: int, kv_version: int | None,
            drop_first: Callable[[list[str]], str] | None = None) -> bool:
        """Copy the KV of the first `num_tokens` slots of `block_ids` into the tier (replacing what `session_id` had
        there), dropping entries for room: the oldest, or `drop_first(candidates)`'s pick among the entries and
        `session_id` (picked: not kept). Whether it was kept."""
        self.discard(session_id)
        nbytes = self.nbytes_for(num_tokens)
        if num_tokens <= 0 or nbytes > self.budget_bytes:
            return False
        while self.bytes_used + nbytes > self.budget_bytes:
            droppable = [i for i in self.entries if i not in self.pinned]
            if not droppable:
                return False
            gone = droppable[0] if drop_first is None else drop_first([*droppable, session_id])
            if gone == session_id:
                return False
            self.bytes_used -= self.entries.pop(gone).nbytes
            self.num_dropped += 1
        keys, values = self.cache.export_blocks(block_ids)  # [layers, blocks, block_size, heads, head_dim]
        keys, values = (t.flatten(1, 2)[:, :num_tokens] for t in (keys, values))
        encoded = self.codec.encode(keys.contiguous(), values.contiguous())
        host = {name: part.to("cpu", copy=True) for name, part in encoded.parts.items()}
        entry = TierEntry(EncodedKV(encoded.codec, encoded.shape, encoded.dtype, host), num_tokens, kv_version)
        self.entries[session_id] = entry
        self.bytes_used += entry.nbytes
        self.num_puts += 1
        self.bytes_out += entry.nbytes
        return True

    def take(self, session_id: str) -> TierEntry | None:
        """The session's entry, removed from the tier; None when it has none."""
        entry = self.entries.pop(session_id, None)
        if entry is not None:
            self.bytes_used -= entry.nbytes
        return entry

    def restore(self, entry: TierEntry, block_ids: list[int]) -> None:
        """Write the entry's KV into `block_ids` (enough blocks for entry.num_tokens, fresh: the slots past it are
        written by the next turn before anything reads them)."""
        device = self.cache.device
        parts = {name: part.to(device, non_blocking=True) for name, part in entry.encoded.parts.items()}
        keys, values = self.codec.decode(EncodedKV(entry.encoded.codec, entry.encoded.shape, entry.encoded.dtype,
                                                   parts))
        layers, tokens, heads, head_dim = entry.encoded.shape
        shape = (layers, len(block_ids) * self.block_size, heads, head_dim)
        full_keys, full_values = keys.new_zeros(shape), values.new_zeros(shape)
        full_keys[:, :tokens], full_values[:, :tokens] = keys, values
        blocked = (layers, len(block_ids), self.block_size, heads, head_dim)
        self.cache.import_blocks(block_ids, full_keys.view(blocked), full_values.view(blocked))
        self.num_hits += 1
        self.bytes_in += entry.nbytes
        self.tokens_restored += entry.num_tokens

    @property
    def stats(self) -> dict[str, int]:
        """Sessions whose KV went in and came back, entries dropped for room, bytes moved each way, bytes held now,
        tokens restored instead of recomputed."""
        return dict(zip(TIER_STATS, (self.num_puts, self.num_hits, self.num_dropped, self.bytes_out, self.bytes_in,
                                     self.bytes_used, self.tokens_restored), strict=True))

    def discard(self, session_id: str) -> None:
        self.take(session_id)

    def clear(self) -> None:
        """Drop every entry (new weights, kv_on_update recompute)."""
        self.entries.clear()
        self.bytes_used = 0
