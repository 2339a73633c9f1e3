"""Where a producer (the rollout driver, the episode runner) stands in its stream of groups, kept in a small
JSON file so that a producer started again (by the supervisor, or by `relayrl run --resume`) neither repeats
nor skips a group of the stream.

Group `index` of a stream is its index-th item in the seeded epoch order (producer.item_stream), so a position
is a set of indices: every index below `next` is stored, and so are those in `stored_above` (groups finish out
of order). Groups in flight when a producer dies are not stored, so a restarted producer runs them again. The
file also lists every producer id that ran the stream: a new producer draws one none of them had.

The file is replaced (written beside it, then renamed) after every group stored: a killed process leaves the
previous or the new position, never half of one.
"""

import json
import os
import pathlib
import secrets


class Position:
    """The stored group indices of one stream and the producer ids that ran it; saved to `path` if given."""

    def __init__(self, path: str | os.PathLike | None = None, next_index: int = 0, stored_above: set[int] | None = None,
                 producer_ids: list[str] | None = None) -> None:
        self.path = pathlib.Path(path) if path is not None else None
        self.next_index = next_index
        self.stored_above = set(stored_above or ())
        self.producer_ids = list(producer_ids or [])

    @classmethod
    def load(cls, path: str | os.PathLike | None) -> "Position":
        """The position saved at `path`; a fresh one when there is none (or no path)."""
        if path is None or not pathlib.Path(path).exists():
            return cls(path)
        data = json.loads(pathlib.Path(path).read_text())
        return cls(path, data["next"], set(data["stored_above"]), data["producer_ids"])

    def new_producer_id(self, configured: str | None = None) -> str:
        """`configured`, or a fresh random id that no producer of this stream had; recorded (and saved)."""
        producer_id = configured
        while producer_id is None or (configured is None and producer_id in self.producer_ids):
            producer_id = secrets.token_hex(4)
        self.producer_ids.append(producer_id)
        self.save()
        return producer_id

    def is_stored(self, index: int) -> bool:
        return index < self.next_index or index in self.stored_above

    def stored(self, index: int) -> None:
        """Group `index` is in the buffer: advance, and save."""
        self.stored_above.add(index)
        while self.next_index in self.stored_above:
            self.stored_above.remove(self.next_index)
            self.next_index += 1
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        data = {"next": self.next_index, "stored_above": sorted(self.stored_above), "producer_ids": self.producer_ids}
        staging = self.path.with_name(f".{self.path.name}.tmp")
        staging.write_text(json.dumps(data))
        os.replace(staging, self.path)
