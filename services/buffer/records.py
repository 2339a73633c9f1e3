"""What the buffer writes into its log besides samples: acks, uses, drops, versions, leases, checkpoints.

A PUT record's payload is the sample's serialized `common_pb2.Sample`, stored as received; a COPY
record's is the same bytes behind a u32 use count; a RETIRED record's is little-endian int64 id
hashes (retired.py). The other payloads are small msgpack values defined here.
"""

import struct
from collections import Counter
from dataclasses import dataclass, field

import msgpack
import numpy as np

from services.buffer.log import RecordKind


@dataclass
class Checkpoint:
    """The state that the segments before a segment left behind; it opens every segment.

    Recovery starts from the checkpoint of the first live segment and replays the records after
    it, so counters and half-arrived groups survive the compaction of older segments.
    """

    accepted: int = 0  # samples ever stored
    acked: int = 0  # samples trained on for good
    dropped: Counter[str] = field(default_factory=Counter)  # samples dropped, by reason
    trainer_version: int = -1  # the trainer's weight version (-1: not told yet)
    open_groups: dict[str, tuple[int, int]] = field(default_factory=dict)  # group id -> (size, arrived)
    consumer: str | None = None  # who took the last lease (None: nobody yet)

    def encode(self) -> bytes:
        return msgpack.packb(
            {
                "accepted": self.accepted,
                "acked": self.acked,
                "dropped": dict(self.dropped),
                "trainer_version": self.trainer_version,
                "open_groups": {key: list(value) for key, value in self.open_groups.items()},
                "consumer": self.consumer,
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, payload: bytes | memoryview) -> "Checkpoint":
        data = msgpack.unpackb(payload, raw=False)
        return cls(
            accepted=data["accepted"],
            acked=data["acked"],
            dropped=Counter(data["dropped"]),
            trainer_version=data["trainer_version"],
            open_groups={key: (size, arrived) for key, (size, arrived) in data["open_groups"].items()},
            consumer=data.get("consumer"),  # absent from logs written before it was added
        )


def ids_record(kind: RecordKind, sample_ids: list[str]) -> tuple[RecordKind, bytes]:
    """An ACK, USE, CONSUMED or RETURNED record."""
    return kind, msgpack.packb(sample_ids, use_bin_type=True)


def lease_record(lease_id: str, sample_ids: list[str], consumer: str) -> tuple[RecordKind, bytes]:
    return RecordKind.LEASE, msgpack.packb([lease_id, sample_ids, consumer], use_bin_type=True)


def decode_lease(payload: bytes | memoryview) -> tuple[str, list[str], str]:
    lease_id, sample_ids, consumer = msgpack.unpackb(payload, raw=False)
    return lease_id, sample_ids, consumer


def drop_record(reason: str, sample_ids: list[str]) -> tuple[RecordKind, bytes]:
    return RecordKind.DROP, msgpack.packb([reason, sample_ids], use_bin_type=True)


def version_record(version: int) -> tuple[RecordKind, bytes]:
    return RecordKind.VERSION, msgpack.packb(version)


def decode_ids(payload: bytes | memoryview) -> list[str]:
    return msgpack.unpackb(payload, raw=False)


def decode_drop(payload: bytes | memoryview) -> tuple[str, list[str]]:
    reason, sample_ids = msgpack.unpackb(payload, raw=False)
    return reason, sample_ids


def decode_version(payload: bytes | memoryview) -> int:
    return msgpack.unpackb(payload)


COPY_HEADER = struct.Struct("<I")  # the use count before a copied sample's bytes


def copy_record(uses: int, payload: bytes) -> tuple[RecordKind, bytes]:
    return RecordKind.COPY, COPY_HEADER.pack(uses) + payload


def decode_copy(payload: bytes | memoryview) -> tuple[int, memoryview]:
    """(use count, the sample's bytes)."""
    (uses,) = COPY_HEADER.unpack_from(payload)
    return uses, memoryview(payload)[COPY_HEADER.size :]


def retired_record(hashes: np.ndarray) -> tuple[RecordKind, bytes]:
    return RecordKind.RETIRED, hashes.astype("<i8", copy=False).tobytes()


def decode_retired(payload: bytes | memoryview) -> np.ndarray:
    return np.frombuffer(payload, dtype="<i8").astype(np.int64)
