"""Continuous batching: which sequences run in the next step.

A step prefills waiting sequences (all their uncached tokens), decodes every running sequence by
one token, or both at once: when every waiting sequence that joins has at most `max_mixed_prefill_len`
uncached tokens, the running sequences decode in the same forward pass (a decode is a prefill of one
token), so requests that arrive one by one do not each cost a step of their own. Prefill goes first
otherwise, so new requests join as soon as blocks allow. When a decode cannot get a block, the most
recently started sequence is preempted: its blocks are freed and it waits to be recomputed
(prefilled again over prompt + output so far).
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.block_manager import BlockManager
from rollout.config import EngineConfig
from rollout.sequence import Sequence, SequenceStatus


@dataclass
class Batch:
    """One step's work. In a prefill, sequences with `prefill_from` set sample from a sibling's logits."""

    seqs: list[Sequence]
    is_prefill: bool  # some sequence runs more than its last token (the runner's general path)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, reclaim: Callable[[], bool] = lambda: False):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_mixed_prefill_len = config.max_mixed_prefill_len
        self.block_manager = block_manager
        self.reclaim = reclaim  # frees some cached blocks nobody is running (idle sessions'); whether it did
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Batch | None:
        if self.running and self._can_mix():
            decode = self._schedule_decode()
            prefill = self._schedule_prefill()
            if decode is None or prefill is None:
                return decode or prefill
            return Batch(decode.seqs + prefill.seqs, is_prefill=True, block_copies=decode.block_copies)
        batch = self._schedule_prefill()
        return batch if batch is not None else self._schedule_decode()

    def _can_mix(self) -> bool:
        """Whether the waiting sequences are short enough to prefill alongside a decode of the running ones.

        The decode rows attend apart from the prefill (rollout/attention.py), but the step waits for the
        prefill's compute: a long prompt gets a step of its own, so it does not stall every decode.
        """
        return bool(self.waiting) and all(seq.num_uncached_tokens <= self.max_mixed_prefill_len for seq in self.waiting)

    def _schedule_prefill(self) -> Batch | None:
        scheduled: list[Sequence] = []
        num_seqs, num_tokens = len(self.running), 0
        while self.waiting:
            seq = self.waiting[0]
            group = 1 + len(seq.forks)
            if num_seqs + group > self.max_num_seqs or num_tokens + seq.num_uncached_tokens > self.max_num_batched_tokens:
                break
            if not self.block_manager.can_allocate(seq):
                if self.reclaim() or (not self.running and self._drop_waiting_cache()):
                    continue
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            for child in seq.forks:
                self.block_manager.fork(seq, child)
                child.prefill_from = seq
            scheduled += [seq, *seq.forks]
            seq.forks = []
            num_seqs += group
            num_tokens += seq.num_uncached_tokens
        for seq in scheduled:
            seq.status = SequenceStatus.RUNNING
        self.running.extend(scheduled)
        return Batch(scheduled, is_prefill=True) if scheduled else None

    def _schedule_decode(self) -> Batch | None:
        scheduled: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        while self.running:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.reclaim():
                    continue
                if self.running:
                    self._preempt(self.running.pop())
                else:
                    self._preempt(seq)
                    break
            else:
                copy = self.block_manager.may_append(seq)
                if copy is not None:
                    copies.append(copy)
                scheduled.append(seq)
        self.running.extend(scheduled)
        return Batch(scheduled, is_prefill=False, block_copies=copies) if scheduled else None

    def _drop_waiting_cache(self) -> bool:
        """Free the blocks a waiting session turn brought (the last such in the queue), so the head can start
        when nothing runs that would free blocks; that turn recomputes them. Whether one was freed."""
        for seq in reversed(list(self.waiting)[1:]):
            if seq.block_table:
                self.block_manager.deallocate(seq)
                return True
        return False

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks (a session's turn keeps
        them: they hold the session's context)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.session is None:
            self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.FINISHED
