"""Paged-KV bookkeeping: which blocks are free, which sequence holds which, and how many share each.

Blocks are reference-counted so the n completions of a prompt share the prompt's blocks; the
shared block a completion is about to write into is copied first (copy-on-write), and the copy
is returned for the model runner to perform on the cache.

Prefix cache: a block full of computed KV is registered under the hash of its tokens chained with
the hash of the block before it, so the hash names the whole prefix up to the block's end (the first block's
chains the sequence's policy version, and the hash of the prompt's images when it has some: the same text under
another LoRA adapter, or with other images, misses). A new
sequence takes the registered blocks of its leading full blocks instead of computing them. A
registered block nobody holds stays reusable in an LRU pool (counted as free) until a fresh block is
needed and none is plainly free. New weights make every cached KV stale: `reset_prefix_cache` drops
every hash, and blocks whose first block of KV predates it are never registered (their KV depends on
the old weights even where it was computed after the update). An adapter-only update of an engine serving LoRA
unmerged resets nothing: the older versions' prefixes stay valid for the sequences still pinned to them. Either way a
sequence whose KV is not all of its own policy version (kv_on_update keep) registers none.
"""

from array import array
from collections import OrderedDict, deque
from hashlib import blake2b

import numpy as np

from rollout.engine.routes import RouteLog
from rollout.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # nobody holds them, no cached KV
        self.evictable_block_ids: OrderedDict[int, None] = OrderedDict()  # nobody holds them, cached KV; LRU first
        self.block_hashes: list[bytes | None] = [None] * num_blocks  # the prefix hash a block is registered under
        self.cached_block_ids: dict[bytes, int] = {}  # prefix hash -> the block holding its KV
        self.block_epochs = [0] * num_blocks  # the weights epoch in which a block's KV was computed
        # Of a mixture-of-experts model: the routes of a registered block's tokens, handed with its KV to the
        # sequences that reuse it (rollout/engine/routes.py)
        self.block_routes: dict[int, object] = {}
        self.epoch = 0  # bumped by reset_prefix_cache
        self.num_queried_tokens = 0  # tokens of the sequences looked up in the prefix cache
        self.num_hit_tokens = 0  # of them, tokens whose KV the cache supplied

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.evictable_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_missing(self, seq: Sequence) -> int:
        """Blocks `seq` still needs to hold all its tokens (a session turn brings the blocks of its context)."""
        return max(0, self.blocks_for(seq.num_slots) - len(seq.block_table))

    def can_allocate(self, seq: Sequence) -> bool:
        hits = self._cached_prefix(seq)
        idle_hits = sum(1 for block_id in hits if self.ref_counts[block_id] == 0)  # counted in num_free_blocks
        return self.blocks_missing(seq) - len(hits) + idle_hits <= self.num_free_blocks

    def allocate(self, seq: Sequence, reuse_prefix: bool = True) -> None:
        """Give a sequence enough blocks for all its tokens (beyond those it holds).

        A sequence that holds none first takes the cached blocks of its prefix (`reuse_prefix`): they count as
        computed (num_cached_tokens), and the last token is always left to compute, for its logits."""
        if reuse_prefix and not seq.block_table and self.enable_prefix_caching:
            hits = self._cached_prefix(seq)
            for block_id in hits:
                if self.ref_counts[block_id] == 0:
                    del self.evictable_block_ids[block_id]
                self.ref_counts[block_id] += 1
            seq.block_table = hits
            seq.num_registered_blocks = len(hits)
            seq.num_cached_tokens = len(hits) * self.block_size
            routes = [self.block_routes.get(block_id) for block_id in hits]
            if hits and all(rows is not None for rows in routes):
                seq.routes = RouteLog.written(seq.routes, 0, np.concatenate(routes))
            self.num_queried_tokens += len(seq)
            self.num_hit_tokens += seq.num_cached_tokens
        seq.block_table += [self._take() for _ in range(self.blocks_missing(seq))]

    def register(self, seq: Sequence) -> None:
        """Offer the full blocks of computed KV of `seq` to the prefix cache (after a step computed some).

        A block whose prefix is already cached elsewhere (computed twice in one step) stays unregistered."""
        num_full = seq.num_cached_tokens // self.block_size
        if num_full <= seq.num_registered_blocks:
            return
        if (self.enable_prefix_caching and self.block_epochs[seq.block_table[0]] == self.epoch
                and seq.context_version in (None, seq.policy_version)):
            hashes = self.prefix_hashes(seq)
            for index in range(seq.num_registered_blocks, num_full):
                block_id, block_hash = seq.block_table[index], hashes[index]
                if self.block_hashes[block_id] is None and block_hash not in self.cached_block_ids:
                    self.block_hashes[block_id] = block_hash
                    self.cached_block_ids[block_hash] = block_id
                    self._keep_routes(seq, index, block_id)
        seq.num_registered_blocks = num_full

    def _keep_routes(self, seq: Sequence, index: int, block_id: int) -> None:
        rows = seq.routes.block(index, self.block_size) if seq.routes is not None else None
        if rows is not None:
            self.block_routes[block_id] = rows

    def take_private(self, count: int) -> list[int]:
        """`count` fresh blocks for KV that is not a plain prefix of tokens (a compacted sequence, see
        rollout/engine/kv_eviction.py): never offered to the prefix cache. The caller checks num_free_blocks first."""
        blocks = [self._take() for _ in range(count)]
        self.mark_uncacheable(blocks)
        return blocks

    def mark_uncacheable(self, block_ids: list[int]) -> None:
        """The KV of these blocks is not what this engine computes for their tokens' prefix (imported from a prefill
        worker, maybe compressed on the wire; or compacted by eviction): no sequence that starts with them offers
        its blocks to the prefix cache."""
        for block_id in block_ids:
            self.block_epochs[block_id] = -1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (new weights): held blocks stay valid for their holders, idle ones become
        plainly free, and no block whose sequence began under the old weights is registered later."""
        self.free_block_ids.extend(self.evictable_block_ids)
        self.evictable_block_ids.clear()
        self.cached_block_ids.clear()
        self.block_routes.clear()
        self.block_hashes = [None] * self.num_blocks
        self.epoch += 1

    def prefix_hashes(self, seq: Sequence) -> list[bytes]:
        """The chained hashes of the full blocks of `seq`'s tokens (kept on the sequence, extended as it grows)."""
        hashes, size = seq.block_hashes, self.block_size
        first = seq.policy_version.to_bytes(8, "little", signed=True)  # another adapter version: a miss
        if seq.multimodal is not None:
            first += seq.multimodal.cache_key  # the same text, other images: a miss
        for index in range(len(hashes), len(seq) // size):
            tokens = array("q", seq.token_ids[index * size : (index + 1) * size]).tobytes()
            hashes.append(blake2b((hashes[-1] if hashes else first) + tokens, digest_size=16).digest())
        return hashes

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks of the leading full blocks of a sequence that holds none, short of its last token."""
        if seq.block_table or not self.enable_prefix_caching:
            return []
        blocks = []
        for block_hash in self.prefix_hashes(seq)[: (len(seq) - 1) // self.block_size]:
            block_id = self.cached_block_ids.get(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent`."""
        for block_id in parent.block_table:
            self.ref_counts[block_id] += 1
        child.block_table = list(parent.block_table)
        child.num_registered_blocks = parent.num_registered_blocks

    def deallocate(self, seq: Sequence) -> None:
        """Release the sequence's blocks; blocks nobody else holds go back to the free list or the LRU pool."""
        self.release(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0
        seq.num_registered_blocks = 0
        seq.num_evicted_tokens = 0

    def release(self, block_table: list[int]) -> None:
        # The last block first: of a prefix, the longest part is the least likely to be asked for again.
        for block_id in reversed(block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is None:
                    self.free_block_ids.append(block_id)
                else:
                    self.evictable_block_ids[block_id] = None

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next decode step of `seq` (writing the KV of its last token) can get its slot."""
        return not self._needs_new_block(seq) or self.num_free_blocks > 0

    def may_append(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the slot of the last token writable; returns (src, dst) when a shared block was copied."""
        if not self._needs_new_block(seq):
            return None
        index = (seq.num_slots - 1) // self.block_size
        if index == len(seq.block_table):
            seq.block_table.append(self._take())
            return None
        shared = seq.block_table[index]
        self.ref_counts[shared] -= 1
        copy = self._take()
        self.block_epochs[copy] = self.block_epochs[shared]  # the copy holds the KV of the shared block's epoch
        seq.block_table[index] = copy
        return shared, copy

    def _needs_new_block(self, seq: Sequence) -> bool:
        index = (seq.num_slots - 1) // self.block_size
        return index == len(seq.block_table) or self.ref_counts[seq.block_table[index]] > 1

    def _take(self) -> int:
        """A fresh block: a plainly free one, else the least recently used cached one (its hash dropped)."""
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.evictable_block_ids.popitem(last=False)
            del self.cached_block_ids[self.block_hashes[block_id]]
            self.block_hashes[block_id] = None
            self.block_routes.pop(block_id, None)
        self.ref_counts[block_id] = 1
        self.block_epochs[block_id] = self.epoch
        return block_id
