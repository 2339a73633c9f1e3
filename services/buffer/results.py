"""What the replay buffer's operations answer (and BufferFull, its refusal of a Put)."""

from dataclasses import dataclass


class BufferFull(Exception):
    """No room for a Put (after waiting, with back-pressure 'block')."""


@dataclass(frozen=True)
class PutResult:
    accepted: int  # samples newly stored
    duplicates: int  # samples whose id was stored already


@dataclass(frozen=True)
class StagedPut:
    """A Put written to the log, not yet durable; `commit_put` finishes it."""

    held_ids: list[str]
    position: int  # log position that must be durable (covers earlier copies of duplicates too)
    result: PutResult


@dataclass(frozen=True)
class LeasedBatch:
    lease_id: str
    payloads: list[bytes]  # serialized common_pb2.Sample, groups contiguous
    trainer_version: int


@dataclass(frozen=True)
class BufferStats:
    pending: int
    leased: int
    consumed: int  # of leased: in leases marked consumed
    staged: int
    acked: int
    dropped: dict[str, int]
    capacity: int
    accepted: int
    duplicates: int
    redelivered: int
    trainer_version: int
    max_staleness: int | None
