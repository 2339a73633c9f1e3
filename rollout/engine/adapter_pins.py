"""Which weight version each sequence samples with across a weight update (LLMEngine.load_weights).

Each sequence is pinned to the engine's version when it was made (`Sequence.policy_version`). A sequence that has not
started (waiting, no token yet: a queued request or session turn) always moves to the newest version. One that has started:
- stays on its version when the update is a LoRA adapter alone, the engine serves adapters unmerged (its W did not
  change, rollout/model/lora.py), kv_on_update is keep and its version is still resident: its tokens come from the
  adapter it started on and carry that version;
- else moves to the newest (a new base, merged serving, kv_on_update recompute, or its version left the resident
  set): its later tokens carry the new version and, with keep, its kv_version says its KV is older.
A moved sequence's prefix hashes are dropped: the first block's hash chains the policy version (block_manager.py).
"""

from collections.abc import Container, Iterable, Mapping

import torch

from rollout.engine.sequence import Sequence, SequenceStatus
from rollout.model.lora import is_adapter


def split_update(named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
                 ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """(the model's own tensors, the LoRA adapters) of an update."""
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    base, adapters = [], {}
    for name, tensor in items:
        if is_adapter(name):
            adapters[name] = tensor
        else:
            base.append((name, tensor))
    return base, adapters


def repin(seqs: Iterable[Sequence], newest: int, resident: Container[int] | None) -> int:
    """Pin every unfinished sequence of `seqs` after version `newest` arrived; `resident`: the versions a started
    sequence may stay on (None: none, all move). Returns how many started sequences moved to another version."""
    seqs, moved = list(seqs), 0
    for seq in seqs:
        if seq.is_finished or seq.policy_version == newest:
            continue
        started = seq.status is SequenceStatus.RUNNING or seq.num_output_tokens > 0  # (a waiting turn has not)
        if started and resident is not None and seq.policy_version in resident:
            continue
        seq.policy_version = newest
        seq.block_hashes = []
        moved += started
    for seq in seqs:  # the completions still waiting to fork a sibling's prompt follow it (they share its KV)
        for child in seq.forks:
            if child.status is SequenceStatus.WAITING and child.policy_version != seq.policy_version:
                child.policy_version, child.block_hashes = seq.policy_version, []
    return moved
