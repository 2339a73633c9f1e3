"""The buffer's durable log: append-only segment files of length-prefixed, CRC32-checked records.

Why a segment log and not SQLite in WAL mode (measured on the 2-core dev machine, samples of
~21 bytes per token, put then ack, 16 samples per commit, one fsync per commit):

    1k tokens:  segment log 8,657 samples/s (188 MB/s)   SQLite WAL synchronous=FULL 2,284/s (50 MB/s)
    8k tokens:  segment log   932 samples/s (161 MB/s)   SQLite WAL synchronous=FULL   471/s (81 MB/s)

(SQLite WAL synchronous=NORMAL, which does not fsync each commit, was slower still: 2,904 and
351/s.) SQLite writes every payload twice (WAL, then checkpoint into the table) and pays B-tree
work per blob; the log writes it once, sequentially, and a put/ack history is exactly the
append-only shape it is good at. Recovery is a sequential scan; compaction deletes whole files.

Layout: `<dir>/0000000001.seg`, `0000000002.seg`, ... Every record is

    u32 body length | u32 crc32(body) | body = u8 kind | payload

Each segment opens with a CHECKPOINT record (the state the earlier segments left, see
records.py), so once older segments are compacted away the first live one still says where
the counters stand. Only the last segment can end in a torn record (a crash mid-write); opening
the log cuts it off there. A bad record inside a sealed segment is corruption, not a torn
write: it raises LogCorruption instead of guessing.
"""

import enum
import os
import pathlib
import struct
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

HEADER = struct.Struct("<II")
SEGMENT_SUFFIX = ".seg"
_IOV_MAX = os.sysconf("SC_IOV_MAX")


class RecordKind(enum.IntEnum):
    CHECKPOINT = 1  # state left by the segments before this one
    PUT = 2  # one serialized common_pb2.Sample
    ACK = 3  # sample ids trained on for good
    USE = 4  # sample ids handed out once more and returned (uniform replay)
    DROP = 5  # a reason and sample ids dropped for it
    VERSION = 6  # the trainer's weight version
    COPY = 7  # a held sample's PUT copied forward by compaction: u32 use count | serialized sample
    RETIRED = 8  # 64-bit hashes of ids done with (retired.py), copied forward by compaction
    LEASE = 9  # a lease id and the sample ids it holds (so a trainer can mark it consumed after a restart)
    CONSUMED = 10  # sample ids trained on (their lease marked consumed), copied forward by compaction
    RETURNED = 11  # sample ids whose consumed mark is void: a lease holding them expired


class LogCorruption(RuntimeError):
    """A sealed segment holds a record that fails its checksum: the log was damaged, not torn."""


@dataclass(frozen=True, slots=True)
class Location:
    """Where a record's payload lies."""

    segment: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class Record:
    kind: RecordKind
    payload: memoryview
    location: Location


def encode_record(kind: RecordKind, payload: bytes) -> tuple[bytes, bytes]:
    """(header + kind byte, payload): written back to back with writev, never joined."""
    head = bytes((kind,))
    crc = zlib.crc32(payload, zlib.crc32(head))
    return HEADER.pack(len(payload) + 1, crc) + head, payload


def _segment_name(index: int) -> str:
    return f"{index:010d}{SEGMENT_SUFFIX}"


def fsync_dir(directory: pathlib.Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def scan(data: memoryview, segment: int) -> tuple[list[Record], int]:
    """Parse records from a segment's bytes; returns (records, end of the last valid record)."""
    records: list[Record] = []
    offset, end = 0, len(data)
    while offset + HEADER.size <= end:
        length, crc = HEADER.unpack_from(data, offset)
        body_start = offset + HEADER.size
        if length == 0 or body_start + length > end:
            break
        body = data[body_start : body_start + length]
        if zlib.crc32(body) != crc or body[0] not in RecordKind._value2member_map_:
            break
        records.append(Record(RecordKind(body[0]), body[1:], Location(segment, body_start + 1, length - 1)))
        offset = body_start + length
    return records, offset


class SegmentLog:
    """Appends records to the active (last) segment; reads payloads back by location.

    Not thread-safe: one event loop owns it. Durability is the caller's choice (see commit.py):
    `append` leaves bytes in the OS page cache (they survive a killed process), `sync_target`
    hands out what an fsync needs to make them survive a machine crash too.
    """

    def __init__(self, directory: pathlib.Path, segment_bytes: int):
        self.directory = directory
        self.segment_bytes = segment_bytes
        self._readers: dict[int, int] = {}  # segment index -> read fd
        self._write_fd = -1
        self._active = 0
        self._tail = 0  # bytes in the active segment
        self.appended = 0  # bytes appended since open (positions for durability waits)
        self.truncated_bytes = 0  # torn tail cut off at open

    @classmethod
    def open(cls, directory: str | os.PathLike, segment_bytes: int, initial_checkpoint: bytes) -> "SegmentLog":
        """Open (or create) the log in `directory`, cutting off a torn tail of the last segment."""
        path = pathlib.Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        log = cls(path, segment_bytes)
        indices = log.segments()
        if indices:
            log._recover_tail(indices)
        remaining = log.segments()
        if remaining:
            log._open_writer(remaining[-1])
        else:
            log._create_segment(indices[-1] if indices else 1, initial_checkpoint)
        return log

    def segments(self) -> list[int]:
        """Indices of the segment files present, oldest first."""
        names = (p.name for p in self.directory.iterdir() if p.name.endswith(SEGMENT_SUFFIX))
        return sorted(int(name.removesuffix(SEGMENT_SUFFIX)) for name in names)

    @property
    def active_segment(self) -> int:
        return self._active

    def _path(self, index: int) -> pathlib.Path:
        return self.directory / _segment_name(index)

    def _recover_tail(self, indices: list[int]) -> None:
        last = indices[-1]
        data = self._path(last).read_bytes()
        _records, valid_end = scan(memoryview(data), last)
        if valid_end < len(data):
            self.truncated_bytes = len(data) - valid_end
            os.truncate(self._path(last), valid_end)
        if valid_end == 0:
            # Crashed while creating this segment, before its checkpoint was written: the previous
            # segment (synced before the roll) is the tail again, or the log starts afresh.
            self._path(last).unlink()
            fsync_dir(self.directory)

    def _open_writer(self, index: int) -> None:
        path = self._path(index)
        self._write_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._active = index
        self._tail = os.fstat(self._write_fd).st_size
        self._reader(index)

    def _create_segment(self, index: int, checkpoint: bytes) -> None:
        self._open_writer(index)
        self._write_chunks(list(encode_record(RecordKind.CHECKPOINT, checkpoint)))
        os.fsync(self._write_fd)
        fsync_dir(self.directory)

    def _reader(self, index: int) -> int:
        fd = self._readers.get(index)
        if fd is None:
            fd = self._readers[index] = os.open(self._path(index), os.O_RDONLY)
        return fd

    def replay(self) -> Iterator[Record]:
        """Every record of every live segment, oldest first (the first is a CHECKPOINT)."""
        indices = self.segments()
        for index in indices:
            data = memoryview(self._path(index).read_bytes())
            records, valid_end = scan(data, index)
            if valid_end != len(data):
                raise LogCorruption(
                    f"segment {_segment_name(index)} in {self.directory}: bad record at byte {valid_end} "
                    f"of {len(data)} (checksum or length); the log is damaged, refusing to guess"
                )
            yield from records

    def needs_roll(self, nbytes: int) -> bool:
        """Whether appending `nbytes` more would overflow the active segment."""
        return self._tail > 0 and self._tail + nbytes > self.segment_bytes

    def roll(self, checkpoint: bytes) -> None:
        """Seal the active segment (fsync) and start the next one with `checkpoint`."""
        os.fsync(self._write_fd)
        os.close(self._write_fd)
        self._create_segment(self._active + 1, checkpoint)

    def append(self, records: Sequence[tuple[RecordKind, bytes]]) -> list[Location]:
        """Write records to the active segment in one system call; returns their payload locations."""
        chunks: list[bytes] = []
        locations: list[Location] = []
        offset = self._tail
        for kind, payload in records:
            head, body = encode_record(kind, payload)
            chunks += (head, body)
            locations.append(Location(self._active, offset + len(head), len(body)))
            offset += len(head) + len(body)
        self._write_chunks(chunks)
        return locations

    def _write_chunks(self, chunks: list[bytes]) -> None:
        total = 0
        for start in range(0, len(chunks), _IOV_MAX):
            part = chunks[start : start + _IOV_MAX]
            size = sum(len(c) for c in part)
            done = os.writev(self._write_fd, part)
            if done < size:  # a short write (signal, nearly full disk): finish it plainly
                rest = memoryview(b"".join(part))[done:]
                while rest:
                    rest = rest[os.write(self._write_fd, rest):]
            total += size
        self._tail += total
        self.appended += total

    def read(self, location: Location) -> bytes:
        """The payload at `location` (served from the page cache in steady state)."""
        data = os.pread(self._reader(location.segment), location.length, location.offset)
        if len(data) != location.length:
            raise LogCorruption(f"segment {location.segment}: short read at {location.offset}")
        return data

    def sync(self) -> None:
        """fsync the active segment here and now (compaction, before it deletes what it copied)."""
        os.fdatasync(self._write_fd)

    def segment_size(self, index: int) -> int:
        return self._tail if index == self._active else self._path(index).stat().st_size

    def sync_target(self) -> tuple[int, int]:
        """(a duplicate fd of the active segment, bytes appended so far): fsync the fd in any
        thread, close it, and everything appended up to that position is durable. The dup keeps
        the fsync valid even if the segment is rolled over meanwhile (rolling syncs it anyway)."""
        return os.dup(self._write_fd), self.appended

    def delete_segment(self, index: int) -> None:
        """Remove a sealed segment whose records are no longer needed (compaction)."""
        if index == self._active:
            raise ValueError(f"segment {index} is the active segment")
        fd = self._readers.pop(index, None)
        if fd is not None:
            os.close(fd)
        self._path(index).unlink()
        fsync_dir(self.directory)

    def close(self) -> None:
        """fsync and close every file."""
        if self._write_fd >= 0:
            os.fsync(self._write_fd)
            os.close(self._write_fd)
            self._write_fd = -1
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
