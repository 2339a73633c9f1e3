"""Continuous batching with chunked prefill: which sequences run in the next step, and how many tokens each.

A step computes at most `max_num_batched_tokens` tokens. The running sequences that decode come first,
one token each; the sequences still prefilling, then the waiting ones that can start (in arrival order),
take chunks of their uncached tokens within what is left. So a long prompt is prefilled over several
steps while the running sequences keep decoding, and prompts that arrive one by one join the running
decode instead of each costing a step of its own. A sequence samples in the step that computes its last
token; the other completions of its request fork its blocks in that step and sample from its logits.
When a decode cannot get a block, the most recently started sequence is preempted: its blocks are freed
and it waits to be recomputed (prompt + output so far, from whatever prefix the cache still holds). A session turn whose
KV went to the host tier gets it back as it starts (`restore`, rollout/engine/sessions.py). A weight
update with kv_on_update recompute preempts every running sequence so (drop_kv).
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rollout.config import EngineConfig
from rollout.engine.block_manager import BlockManager
from rollout.engine.sequence import Sequence, SequenceStatus


@dataclass
class Batch:
    """One step's work.

    Each sequence of `seqs` computes `num_new_tokens[seq.seq_id]` tokens from its num_cached_tokens,
    except those with `prefill_from` set, which sample from a sibling's logits. `sampled` are the
    sequences that sample a token this step: every one whose last token is computed, and those forks.
    """

    seqs: list[Sequence]
    num_new_tokens: dict[int, int]  # seq_id -> tokens computed this step
    sampled: list[Sequence]
    is_prefill: bool  # some sequence computes other than just its last token (the runner's general path)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    observe: set[int] = field(default_factory=set)  # seq_ids whose attention the step reports (kv_eviction.py)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, reclaim: Callable[[], bool] = lambda: False,
                 restore: Callable[[Sequence, bool], None] = lambda seq, must: None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.reclaim = reclaim  # frees some cached blocks nobody is running (idle sessions'); whether it did
        self.restore = restore  # brings a session turn's KV back from the host tier (SessionTable.restore)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Batch | None:
        decodes, copies = self._schedule_decodes()
        num_new_tokens = {seq.seq_id: 1 for seq in decodes}
        budget = self.max_num_batched_tokens - len(decodes)
        prefills = []
        for seq in [seq for seq in self.running if seq.prefilling]:
            if budget > 0:
                num_new_tokens[seq.seq_id] = min(seq.num_uncached_tokens, budget)
                budget -= num_new_tokens[seq.seq_id]
                prefills.append(seq)
        for seq in self._start_waiting(budget):
            num_new_tokens[seq.seq_id] = min(seq.num_uncached_tokens, budget)
            budget -= num_new_tokens[seq.seq_id]
            prefills.append(seq)
        if not decodes and not prefills:
            return None
        sampled: list[Sequence] = list(decodes)
        forks: list[Sequence] = []
        for seq in prefills:
            if seq.num_cached_tokens + num_new_tokens[seq.seq_id] == len(seq):
                sampled.append(seq)
                for child in seq.forks:
                    self.block_manager.fork(seq, child)
                    child.prefill_from = seq
                    child.status = SequenceStatus.RUNNING
                sampled += seq.forks
                forks += seq.forks
                seq.forks = []
        self.running.extend(forks)
        is_prefill = any(num_new_tokens[seq.seq_id] > 1 or seq.num_cached_tokens != len(seq) - 1 for seq in prefills)
        return Batch(decodes + prefills + forks, num_new_tokens, sampled, is_prefill, copies)

    def update(self, batch: Batch) -> None:
        """After the step ran: its tokens are cached, and the blocks they filled are offered to the prefix cache."""
        for seq in batch.seqs:
            if seq.prefill_from is not None:
                seq.num_cached_tokens = len(seq)
                seq.prefill_from = None
            else:
                seq.num_cached_tokens += batch.num_new_tokens[seq.seq_id]
            self.block_manager.register(seq)
        for seq in batch.sampled:
            seq.prefilling = False

    def _schedule_decodes(self) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """A slot for the next token of every running sequence that decodes, preempting when blocks run out."""
        kept: list[Sequence] = []
        decodes: list[Sequence] = []
        copies: list[tuple[int, int]] = []
        while self.running:
            seq = self.running.popleft()
            if seq.prefilling:  # its blocks were all allocated when it started
                kept.append(seq)
                continue
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
                decodes.append(seq)
                kept.append(seq)
        self.running = deque(kept)
        return decodes, copies

    def _start_waiting(self, budget: int) -> list[Sequence]:
        """Start waiting sequences, in order, while slots, blocks and the step's budget allow (each takes its
        prefix from the cache, then at least one token of the budget)."""
        started: list[Sequence] = []
        num_seqs = sum(1 + len(seq.forks) for seq in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            group = 1 + len(seq.forks)  # the forks join when its prefill completes; their slots are kept now
            if num_seqs + group > self.max_num_seqs:
                break
            if seq.session is not None and not seq.block_table:
                self.restore(seq, not self.running)
            if not self.block_manager.can_allocate(seq):
                if self.reclaim() or (not self.running and self._drop_waiting_cache()):
                    continue
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            seq.prefilling = True
            self.running.append(seq)
            started.append(seq)
            num_seqs += group
            budget -= min(seq.num_uncached_tokens, budget)
        return started

    def _drop_waiting_cache(self) -> bool:
        """Free the blocks a waiting session turn brought (the last such in the queue), so the head can start
        when nothing runs that would free blocks; that turn recomputes them. Whether one was freed."""
        for seq in reversed(list(self.waiting)[1:]):
            if seq.block_table:
                self._drop(seq)
                return True
        return False

    def drop_kv(self) -> None:
        """Drop the KV of every sequence (new weights, kv_on_update recompute): the running ones are preempted, in
        their order ahead of the waiting ones, and waiting session turns give back the blocks they brought. Each
        recomputes its context (from whatever prefix the cache holds) before its next token."""
        while self.running:
            self._preempt(self.running.pop())
        for seq in self.waiting:
            if seq.block_table:
                self._drop(seq)

    def _preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.prefilling = False
        self._drop(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _drop(self, seq: Sequence) -> None:
        """Free the blocks of a sequence that will recompute them (its next KV is of the weights it runs with then)."""
        self.block_manager.deallocate(seq)
        seq.context_version = None

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
