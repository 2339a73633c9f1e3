"""Paged-KV bookkeeping: which blocks are free, which sequence holds which, and how many share each.

Blocks are reference-counted so the n completions of a prompt share the prompt's blocks; the
shared block a completion is about to write into is copied first (copy-on-write), and the copy
is returned for the model runner to perform on the cache.
"""

from collections import deque

from rollout.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_missing(self, seq: Sequence) -> int:
        """Blocks `seq` still needs to hold all its tokens (a session turn brings the blocks of its context)."""
        return max(0, self.blocks_for(len(seq)) - len(seq.block_table))

    def can_allocate(self, seq: Sequence) -> bool:
        return self.blocks_missing(seq) <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give a sequence enough blocks for all its tokens (beyond those it holds)."""
        seq.block_table += [self._take() for _ in range(self.blocks_missing(seq))]

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let `child` share every block of `parent`."""
        for block_id in parent.block_table:
            self.ref_counts[block_id] += 1
        child.block_table = list(parent.block_table)

    def deallocate(self, seq: Sequence) -> None:
        """Release the sequence's blocks; blocks nobody else holds go back to the free list."""
        self.release(seq.block_table)
        seq.block_table = []
        seq.num_cached_tokens = 0

    def release(self, block_table: list[int]) -> None:
        for block_id in reversed(block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next decode step of `seq` (writing the KV of its last token) can get its slot."""
        return not self._needs_new_block(seq) or self.num_free_blocks > 0

    def may_append(self, seq: Sequence) -> tuple[int, int] | None:
        """Make the slot of the last token writable; returns (src, dst) when a shared block was copied."""
        if not self._needs_new_block(seq):
            return None
        index = (len(seq) - 1) // self.block_size
        if index == len(seq.block_table):
            seq.block_table.append(self._take())
            return None
        shared = seq.block_table[index]
        self.ref_counts[shared] -= 1
        seq.block_table[index] = self._take()
        return shared, seq.block_table[index]

    def _needs_new_block(self, seq: Sequence) -> bool:
        index = (len(seq) - 1) // self.block_size
        return index == len(seq.block_table) or self.ref_counts[seq.block_table[index]] > 1

    def _take(self) -> int:
        block_id = self.free_block_ids.popleft()
        self.ref_counts[block_id] = 1
        return block_id
