"""KV eviction for long contexts: each sequence keeps at most `kv_budget_tokens` cache slots.

When a sequence's cached slots reach the budget plus one block, it is compacted back to the budget: the
kept tokens' KV moves, in order, into fresh blocks (keys carry their RoPE positions, so a kept token
needs no recompute), the old blocks are released, and later tokens continue after them (a token at
position p sits in slot p - num_evicted_tokens; attention masks by slot). Which tokens stay:

- `window` (StreamingLLM): the first `kv_sink_tokens` (attention sinks) and the most recent ones.
- `snapkv` (SnapKV): the sinks, the last `kv_observation_window` tokens, and of the others those that the
  latest queries attend to most, chosen per layer and kv head: the step that triggers the compaction
  reports the attention of its last `kv_observation_window` queries (the prompt's last ones after a
  prefill, the one new token in a decode), averaged over them and over each kv head's query heads.

Session turns keep their whole context (no eviction): their KV goes back to the session between turns.
Compaction needs the budget's blocks free; when they are not, it waits for a later step.
A compacted sequence's blocks are never offered to the prefix cache (they are no plain prefix).
"""

import torch

from rollout.config import EngineConfig
from rollout.engine.block_manager import BlockManager
from rollout.engine.scheduler import Batch
from rollout.engine.sequence import Sequence
from rollout.kv.cache import KVCache, device_ids
from rollout.kv.quantized import QuantizedKVCache


class KVEvictor:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, cache: KVCache | QuantizedKVCache):
        self.method = config.kv_eviction
        self.budget = config.kv_budget_tokens
        self.sinks = config.kv_sink_tokens
        self.window = config.kv_observation_window
        self.block_manager = block_manager
        self.cache = cache
        self.threshold = self.budget + block_manager.block_size
        self.num_evicted_tokens = 0
        self.num_compactions = 0

    def plan(self, batch: Batch) -> list[tuple[Sequence, int]]:
        """The sequences this step takes to the threshold, each with the seq_id whose queries score its KV (its
        own, or the sibling's it samples from); snapkv marks them for observation in the batch."""
        due = []
        for seq in batch.sampled:
            if seq.session is not None:
                continue
            source = seq.prefill_from or seq
            if len(seq) - seq.num_evicted_tokens >= self.threshold:
                due.append((seq, source.seq_id))
        if self.method == "snapkv":
            batch.observe.update(source for _, source in due)
        return due

    def evict(self, due: list[tuple[Sequence, int]], observations: dict[int, list[torch.Tensor]]) -> None:
        """Compact each unfinished sequence of `due` to the budget (after the step ran and was post-processed)."""
        for seq, source in due:
            if seq.is_finished or not seq.block_table:
                continue
            slots = seq.num_cached_tokens - seq.num_evicted_tokens
            needed = self.block_manager.blocks_for(self.budget)
            if needed > self.block_manager.num_free_blocks:
                continue
            keep = self.select(slots, observations.get(source))
            new_table = self.block_manager.take_private(needed)
            compact(self.cache, seq.block_table, new_table, keep)
            self.block_manager.release(seq.block_table)
            seq.block_table = new_table
            seq.num_evicted_tokens += slots - self.budget
            self.num_evicted_tokens += slots - self.budget
            self.num_compactions += 1

    def select(self, slots: int, importance: list[torch.Tensor] | None) -> torch.Tensor:
        """Slots to keep, [num_layers, kv_heads, budget] in increasing order (one set for every layer and head when
        the method scores nothing), on the cache's device (where the scores are)."""
        layers, heads, device = self.cache.num_layers, self.cache.num_kv_heads, self.cache.device
        sinks = torch.arange(self.sinks, device=device)
        if self.method == "window" or importance is None:
            keep = torch.cat([sinks, torch.arange(slots - (self.budget - self.sinks), slots, device=device)])
            return keep.expand(layers, heads, -1)
        recent = torch.arange(slots - self.window, slots, device=device)
        middle = torch.stack([layer[:, self.sinks : slots - self.window] for layer in importance])  # [L, H, candidates]
        chosen = middle.topk(self.budget - self.sinks - self.window, dim=-1).indices + self.sinks
        fixed = torch.cat([sinks, recent]).expand(layers, heads, -1)
        return torch.cat([fixed, chosen], dim=-1).sort(dim=-1).values


@torch.inference_mode()
def compact(cache: KVCache | QuantizedKVCache, old_table: list[int], new_table: list[int], keep: torch.Tensor) -> None:
    """Write the KV of slots keep[l, h] (of old_table's blocks) to slots 0.. of new_table, layer by layer and
    kv head by kv head."""
    block_size = cache.block_size
    count = keep.shape[-1]
    target_slots = [new_table[s // block_size] * block_size + s % block_size for s in range(count)]
    old_ids, targets = device_ids(cache.device, old_table, target_slots)
    heads = torch.arange(cache.num_kv_heads, device=cache.device)
    for layer in range(cache.num_layers):
        keys, values = cache.read_blocks(layer, old_ids)
        rows = keep[layer].T.to(cache.device)  # [count, heads]
        kept_keys = keys.view(-1, cache.num_kv_heads, cache.head_dim)[rows, heads]
        kept_values = values.view(-1, cache.num_kv_heads, cache.head_dim)[rows, heads]
        if layer == 0:
            cache.plan_write(target_slots, targets)
        cache.write(layer, targets, kept_keys, kept_values)
