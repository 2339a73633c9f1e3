"""Several senders of one version: with pipeline stages, each stage's first rank publishes its own layers (no gather
to rank 0), and the receivers commit the version once every stage's part has arrived (docs/architecture.md,
"Several senders").

Sender 0 is the trainer's rank 0: it alone talks to the receivers (broadcaster.py, `use_senders`) and decides every
round. Sender s > 0 (the first rank, dp 0 and tp 0, of stage s) decides nothing. Per publish every sender lays its
own tensors out in buckets of its own and packs them, with each bucket's checksum (`pack_part`), and tells sender 0
that layout (`announce`); the version's manifest is every sender's buckets one sender after the other (`join_parts`),
each bucket's part naming its sender and checksum, which every receiver verifies. Then, for each round sender 0 starts
(a version refused as not newer goes out again under the next one), sender s takes its `Assignment`: a group of its
own to the receivers, named by sender 0 on sender 0's rendezvous store, which it forms as that group's rank 0 (or keeps
while the name is the same), and broadcasts its packed buckets there by the round's deadline. It reports nothing back:
a part that did not arrive fails the version at every receiver by the deadline, naming its sender, and sender 0 learns
that from their CommitUpdate replies; a failed round renames every group, so the next one forms them all anew.

The senders coordinate on a gloo group of their own (`SenderGroup`, made by every rank together): an overlapped
publish runs on a thread of its own while the next step's pipeline sends go on the trainer's own groups.
"""

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from services.weights import (
    BucketSender,
    GroupSpec,
    Manifest,
    Transfer,
    TransferError,
    allocate_staging,
    deadline_after,
    make_group,
    pack_bucket,
    unpack_buckets,
)
from services.weights.delta import WHOLE, BucketPart, bucket_checksum
from trainer.broadcast.config import BroadcastConfig
from trainer.broadcast.plan import BroadcastPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SenderPart:
    """One sender's share of a version: its buckets (a manifest of its own) and the checksum of each."""

    manifest: Manifest
    checksums: tuple[int, ...]


@dataclass(frozen=True)
class Assignment:
    """What sender 0 tells sender s for one round."""

    version: int
    spec: GroupSpec  # sender s's group, as its rank 0
    timeout_s: float  # what is left of the round's deadline


def pack_part(plan: BroadcastPlan, tensors: Mapping[str, torch.Tensor]) -> tuple[SenderPart, dict[str, torch.Tensor]]:
    """A sender's tensors laid out in buckets (merge order, as any publish lays them) and packed, on the CPU: its
    part, and views of the packed tensors by name (sent straight from the buckets' memory, no second copy)."""
    manifest = plan.manifest(tensors)
    buffers = allocate_staging(manifest, torch.device("cpu"))
    with torch.no_grad():
        for index in range(len(manifest.bucket_sizes)):
            pack_bucket(manifest, index, tensors, out=buffers[index])
    return SenderPart(manifest, tuple(bucket_checksum(b) for b in buffers)), unpack_buckets(manifest, buffers)


def join_parts(parts: Sequence[SenderPart]) -> tuple[Manifest, tuple[BucketPart, ...]]:
    """One version from every sender's part: sender 0's buckets, then sender 1's, ...; each bucket's part names its
    sender and checksum. A tensor sent by two senders is refused (ValueError)."""
    slots, sizes, wire, seen = [], [], [], {}
    for sender, part in enumerate(parts):
        first = len(sizes)
        for slot in part.manifest.slots:
            if seen.setdefault(slot.name, sender) != sender:
                raise ValueError(f"tensor {slot.name!r} is sent by senders {seen[slot.name]} and {sender}")
            slots.append(replace(slot, bucket=first + slot.bucket))
        for size, checksum in zip(part.manifest.bucket_sizes, part.checksums, strict=True):
            wire.append(BucketPart(len(sizes), WHOLE, size, sender=sender, checksum=checksum))
            sizes.append(size)
    return Manifest(tuple(slots), tuple(sizes)), tuple(wire)


class SenderGroup:
    """The senders' own process group: sender s is the first rank of pipeline stage s (sender 0: the trainer's rank
    0). Made collectively by every rank of the trainer; `index` is this rank's sender number, None for the others."""

    def __init__(self, mesh_ranks: torch.Tensor, rank: int, timeout_s: float):
        """`mesh_ranks`: the ranks of the (pp, dp, tp) mesh; `timeout_s`: the longest a sender waits for sender 0
        (a whole publish, whatever its receivers do)."""
        self.ranks: list[int] = [int(r) for r in mesh_ranks[:, 0, 0].tolist()]
        group = dist.new_group(self.ranks, timeout=timedelta(seconds=timeout_s), backend="gloo")
        self.index = self.ranks.index(rank) if rank in self.ranks else None
        self._group = group if self.index is not None else None

    @property
    def size(self) -> int:
        return len(self.ranks)

    def gather(self, obj: object) -> list | None:
        """Every sender's `obj`, in sender order, on sender 0 (None on the others)."""
        out = [None] * self.size if self.index == 0 else None
        dist.gather_object(obj, out, dst=self.ranks[0], group=self._group)
        return out

    def broadcast(self, obj: object) -> object:
        """Sender 0's `obj` on every sender."""
        payload = [obj if self.index == 0 else None]
        dist.broadcast_object_list(payload, src=self.ranks[0], group=self._group)
        return payload[0]


class Peers:
    """Sender 0's side: every sender's part, once per publish, and the other senders' assignments, once per round."""

    def __init__(self, group: SenderGroup):
        if group.index != 0:
            raise ValueError(f"Peers is sender 0's side; this rank is sender {group.index}")
        self.group = group
        self._parts: list[SenderPart] | None = None

    def parts(self, own: SenderPart) -> list[SenderPart]:
        """Every sender's part (sender 0's: `own`), asked once per publish, whatever its rounds."""
        if self._parts is None:
            self._parts = self.group.gather(own)
        return self._parts

    def assign(self, own: GroupSpec, version: int, deadline: float) -> None:
        """Start a round of `version`: sender s forms (or keeps) its group, `own`'s (sender 0's, as its rank 0)
        under a name of its own, and broadcasts its buckets there by `deadline`."""
        left = deadline - time.monotonic()
        self.group.broadcast([None, *(Assignment(version, sender_spec(own, sender), left)
                                      for sender in range(1, self.group.size))])

    def end(self) -> None:
        """The publish is over (its last round sent, or none): the other senders return from `follow`."""
        if self._parts is not None:
            self.group.broadcast(None)
        self._parts = None


class StageSender:
    """Sender s > 0: `follow(tensors)` for every publish, on the same step as sender 0's (collective among the
    senders); `close()` at the end."""

    def __init__(self, group: SenderGroup, config: BroadcastConfig | None = None):
        if not group.index:
            raise ValueError("StageSender is the side of senders 1, 2, ...; sender 0 publishes (broadcaster.py)")
        self.group = group
        self._plan = BroadcastPlan(config or BroadcastConfig())
        self._sender = BucketSender()
        self._transfer: Transfer | None = None

    def follow(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Take part in one publish: announce this sender's part, then send it in each round sender 0 starts."""
        part, packed = self.announce(tensors)
        while (assignment := self.next_assignment()) is not None:
            self.send(assignment, part, packed)

    def announce(self, tensors: Mapping[str, torch.Tensor]) -> tuple[SenderPart, dict[str, torch.Tensor]]:
        """Pack this sender's tensors (detached, cast as configured) and tell sender 0 their part (pack_part)."""
        part, packed = pack_part(self._plan, self._plan.prepare(tensors))
        self.group.gather(part)
        return part, packed

    def next_assignment(self) -> Assignment | None:
        """This sender's part of the next round, or None once the publish is over."""
        assignments = self.group.broadcast(None)
        return None if assignments is None else assignments[self.group.index]

    def send(self, assignment: Assignment, part: SenderPart, packed: Mapping[str, torch.Tensor]) -> None:
        """Form (or keep) this sender's group and broadcast its buckets by the round's deadline. A failure is logged
        and the group dropped: the receivers fail the version, naming this sender, and sender 0 renames every group."""
        deadline = deadline_after(assignment.timeout_s)
        spec = assignment.spec
        try:
            transfer = self._group_for(spec, assignment.timeout_s)
            self._sender.send(transfer, part.manifest, packed, deadline)
        except TransferError as exc:
            log.warning("sender %d: version %d's part (%d buckets) not sent: %s", self.group.index,
                        assignment.version, len(part.manifest.bucket_sizes), exc)
            self.close()

    def close(self, wait_s: float = 0.0) -> None:
        transfer, self._transfer = self._transfer, None
        if transfer is not None:
            transfer.close(wait_s)

    def _group_for(self, spec: GroupSpec, timeout_s: float) -> Transfer:
        held = self._transfer
        if held is not None and held.spec.group_name == spec.group_name and held.spec.world_size == spec.world_size:
            return held
        self.close()
        if spec.existing:
            raise TransferError(f"group {spec.group_name} is to be reused but this sender does not hold it")
        self._transfer = make_group(spec, timeout_s, None, torch.device("cpu"), cuda_ipc=False)
        return self._transfer


def sender_spec(spec: GroupSpec, sender: int) -> GroupSpec:
    """Sender `sender`'s group as `spec`'s member sees it: the same store, ranks and backend under a name of its own."""
    return spec if sender == 0 else replace(spec, group_name=f"{spec.group_name}-s{sender}")
