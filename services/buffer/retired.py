"""Every sample id (and group id) the buffer is done with, kept for the life of its data dir.

A Put of an id the buffer ever stored is a duplicate forever, also once the segment holding its
PUT is compacted away and across restarts. So the ids of samples acked or dropped, and of groups
finished or closed, are kept as 64-bit hashes (blake2b of the id, sample and group ids apart):
8 bytes each in a sorted numpy array, plus a set of recent ones merged into it in batches. In the
log they are RETIRED records of the same 8 bytes per id (records.py), copied forward by
compaction (buffer.py), so a data dir costs 8 bytes of disk and ~16 bytes of memory (this set and
the per-segment lists compaction copies from) per id it ever stored.

A hash collision makes a fresh id look retired: its Put counts it as a duplicate. The chance
that any of n fresh ids collides with one of n retired ones is about n^2 / 2^64 (n = 10^7 ids:
5e-6; 10^8: 5e-4).
"""

import hashlib

import numpy as np

_MERGE_AT = 1 << 16  # recent hashes held as Python ints before they join the sorted array


def sample_hash(sample_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(b"s" + sample_id.encode(), digest_size=8).digest(), "little")


def group_hash(group_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(b"g" + group_id.encode(), digest_size=8).digest(), "little")


def sample_hashes(sample_ids: list[str]) -> np.ndarray:
    return np.fromiter((sample_hash(i) for i in sample_ids), dtype=np.uint64, count=len(sample_ids))


class RetiredIds:
    """A set of 64-bit id hashes: add in bulk, test one at a time."""

    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype=np.uint64)
        self._recent: set[int] = set()

    def __len__(self) -> int:
        self._merge()
        return len(self._sorted)

    def __contains__(self, key: int) -> bool:
        if key in self._recent:
            return True
        index = int(np.searchsorted(self._sorted, np.uint64(key)))
        return index < len(self._sorted) and int(self._sorted[index]) == key

    def has_sample(self, sample_id: str) -> bool:
        return sample_hash(sample_id) in self

    def has_group(self, group_id: str) -> bool:
        return group_hash(group_id) in self

    def add(self, hashes: np.ndarray) -> None:
        self._recent.update(hashes.tolist())
        if len(self._recent) >= _MERGE_AT:
            self._merge()

    def _merge(self) -> None:
        if self._recent:
            recent = np.fromiter(self._recent, dtype=np.uint64, count=len(self._recent))
            self._sorted = np.union1d(self._sorted, recent)
            self._recent.clear()
