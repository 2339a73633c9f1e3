"""Every sample id (and group id) the buffer is done with, kept for the life of its data dir.

A Put of an id the buffer ever stored is a duplicate forever, also once the segment holding its
PUT is compacted away and across restarts. So the ids of samples acked or dropped, and of groups
finished or closed, are kept as 64-bit hashes (blake2b of the id, sample and group ids apart,
read as int64): 8 bytes each in a sorted numpy array, plus a set of recent ones merged into it
in batches. In the log they are RETIRED records of the same 8 bytes per id (records.py), copied
forward by compaction (compaction.py), so a data dir costs 8 bytes of disk and ~16 bytes of memory
(this set and the per-segment lists compaction copies from) per id it ever stored.

A hash collision makes a fresh id look retired: its Put counts it as a duplicate. The chance
that any of n fresh ids collides with one of n retired ones is about n^2 / 2^64 (n = 10^7 ids:
5e-6; 10^8: 5e-4).
"""

import hashlib

import numpy as np

_MERGE_AT = 1 << 16  # recent hashes held as Python ints before they join the sorted array


def _digest(prefix: bytes, name: str) -> bytes:
    return hashlib.blake2b(prefix + name.encode(), digest_size=8).digest()


def group_hash(group_id: str) -> int:
    return int.from_bytes(_digest(b"g", group_id), "little", signed=True)


def sample_hashes(sample_ids: list[str]) -> np.ndarray:
    return np.frombuffer(b"".join(_digest(b"s", i) for i in sample_ids), dtype="<i8").astype(np.int64)


class RetiredIds:
    """A set of 64-bit id hashes: add in bulk, test one at a time."""

    def __init__(self) -> None:
        self._sorted = np.empty(0, dtype=np.int64)
        self._recent: set[int] = set()

    def __len__(self) -> int:
        self._merge()
        return len(self._sorted)

    def __contains__(self, key: int) -> bool:
        if key in self._recent:
            return True
        index = int(self._sorted.searchsorted(np.int64(key)))
        return index < len(self._sorted) and int(self._sorted[index]) == key

    def contains(self, hashes: np.ndarray) -> np.ndarray:
        """A bool per hash."""
        recent = self._recent
        return self._in_sorted(hashes) | np.fromiter((h in recent for h in hashes.tolist()), bool, len(hashes))

    def _in_sorted(self, hashes: np.ndarray) -> np.ndarray:
        index = self._sorted.searchsorted(hashes)
        found = np.zeros(len(hashes), dtype=bool)
        inside = index < len(self._sorted)
        found[inside] = self._sorted[index[inside]] == hashes[inside]
        return found

    def has_group(self, group_id: str) -> bool:
        return group_hash(group_id) in self

    def add(self, hashes: np.ndarray) -> None:
        self._recent.update(hashes.tolist())
        if len(self._recent) >= _MERGE_AT:
            self._merge()

    def _merge(self) -> None:
        if self._recent:
            recent = np.unique(np.fromiter(self._recent, dtype=np.int64, count=len(self._recent)))
            recent = recent[~self._in_sorted(recent)]
            self._sorted = np.insert(self._sorted, self._sorted.searchsorted(recent), recent)  # O(n), no re-sort
            self._recent.clear()
