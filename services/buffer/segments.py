"""What each log segment holds that must outlive it: the bookkeeping compaction reads (compaction.py).

A segment's live bytes are what compaction must copy forward before deleting it: the payloads of the
held samples whose PUT (or COPY) lies there, the CONSUMED marks of held samples made there, and the
hashes of the ids its records retired (8 bytes each). Open leases are tracked by the segment of their
LEASE record. Pure bookkeeping over sample ids and locations: no I/O.
"""

from collections import Counter, defaultdict

import numpy as np

from services.buffer.entries import NewSample
from services.buffer.log import Location


class SegmentLiveness:
    """Held samples, trained marks, open leases and retired hashes, by the segment that holds them."""

    def __init__(self) -> None:
        self.where: dict[str, Location] = {}  # held sample id -> its PUT (or COPY) payload
        self.held_in: defaultdict[int, dict[str, None]] = defaultdict(dict)  # segment -> held ids there, in order
        self.live_bytes: Counter[int] = Counter()  # segment -> what compaction must copy from it
        self.facts: defaultdict[int, list[np.ndarray]] = defaultdict(list)  # segment -> hashes it retired
        self.trained_at: dict[str, int] = {}  # held sample marked trained -> segment of its CONSUMED record
        self.trained_in: defaultdict[int, dict[str, None]] = defaultdict(dict)  # segment -> those ids
        self.lease_at: dict[str, int] = {}  # open lease -> segment of its LEASE record

    def note_held(self, samples: list[NewSample]) -> None:
        for sample in samples:
            self.place(sample.sample_id, sample.ref)

    def move(self, sample_id: str, location: Location) -> None:
        self.unplace(sample_id)
        self.place(sample_id, location)

    def place(self, sample_id: str, location: Location) -> None:
        self.where[sample_id] = location
        self.held_in[location.segment][sample_id] = None
        self.live_bytes[location.segment] += location.length

    def resolve(self, sample_ids: list[str]) -> None:
        """These samples are no longer held (their segments need not keep them)."""
        for sample_id in sample_ids:
            self.unplace(sample_id)
        self.forget_trained(sample_ids)

    def unplace(self, sample_id: str) -> None:
        where = self.where.pop(sample_id)
        del self.held_in[where.segment][sample_id]
        self.live_bytes[where.segment] -= where.length

    def note_trained(self, sample_ids: list[str], segment: int) -> None:
        """These held samples are marked trained by a CONSUMED record in `segment`."""
        self.forget_trained(sample_ids)
        for sample_id in sample_ids:
            self.trained_at[sample_id] = segment
            self.trained_in[segment][sample_id] = None
            self.live_bytes[segment] += _trained_bytes(sample_id)

    def forget_trained(self, sample_ids: list[str]) -> None:
        for sample_id in sample_ids:
            segment = self.trained_at.pop(sample_id, None)
            if segment is not None:
                del self.trained_in[segment][sample_id]
                self.live_bytes[segment] -= _trained_bytes(sample_id)

    def note_facts(self, hashes: np.ndarray, segment: int) -> None:
        self.facts[segment].append(hashes)
        self.live_bytes[segment] += hashes.nbytes

    def forget_segment(self, index: int) -> None:
        """Segment `index` was deleted (after compaction copied what it held forward)."""
        self.held_in.pop(index, None)
        self.live_bytes.pop(index, None)
        self.facts.pop(index, None)
        self.trained_in.pop(index, None)


def _trained_bytes(sample_id: str) -> int:
    """What a sample's CONSUMED mark costs a segment that compaction copies it from (about)."""
    return len(sample_id) + 2
