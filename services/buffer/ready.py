"""The index's ready queues: group keys in hand-out order, with uniform random picks in O(batch)."""

import random
from collections import OrderedDict
from collections.abc import Iterator

from services.buffer.entries import GroupKey


class GroupQueue:
    """Group keys in hand-out order, with uniform random picks in O(batch)."""

    def __init__(self) -> None:
        self._order: OrderedDict[GroupKey, None] = OrderedDict()
        self._keys: list[GroupKey] = []
        self._index: dict[GroupKey, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: GroupKey) -> bool:
        return key in self._index

    def add(self, key: GroupKey, front: bool = False) -> None:
        if key not in self._index:
            self._index[key] = len(self._keys)
            self._keys.append(key)
            self._order[key] = None
        if front:
            self._order.move_to_end(key, last=False)

    def discard(self, key: GroupKey) -> None:
        index = self._index.pop(key, None)
        if index is None:
            return
        last = self._keys.pop()
        if index < len(self._keys):
            self._keys[index] = last
            self._index[last] = index
        del self._order[key]

    def oldest_first(self) -> Iterator[GroupKey]:
        return iter(self._order)

    def random(self, rng: random.Random, count: int) -> list[GroupKey]:
        return rng.sample(self._keys, min(count, len(self._keys)))
