"""The buffer's images, stored once by content hash: a GRPO group of n samples sharing one image keeps one copy.

A sample put with image bytes (common.proto's ImageRef.data) is logged without them: its PUT record keeps the
refs (sha256, media type, grid, token count), the bytes go to `<data_dir>/images/<sha256 hex>`, written before the
PUT record is appended (temporary file, fsync, rename, fsync of the folder; no fsyncs under fsync 'never'), so a
durable PUT never points at a missing image. A sample may also carry only the ref of an image the buffer holds.

Each image is counted by the held samples that refer to it (compaction moves their records, not the images) and
deleted once none does and the record that let the last one go (ACK, DROP) is durable: a crash before that brings
the sample back with its image. On open, recovery counts the held samples again and any image no held sample refers
to (an ack whose deletion a crash cut off) is deleted. Handed out, a sample gets its images' bytes back inline, so
a trainer sees the sample as the producer sent it. Pure storage and counting: the buffer decides when (buffer.py).
"""

import hashlib
import os
import pathlib
from collections import Counter

from protos import common_pb2
from protos.codec import CodecError
from services.buffer.log import LogCorruption, fsync_dir

_TMP_SUFFIX = ".tmp"


class ImageStore:
    """Image files by SHA-256 in one folder, counted by the held samples that refer to them."""

    def __init__(self, directory: pathlib.Path, fsync: bool):
        self.directory = directory
        self.fsync = fsync
        self.directory.mkdir(parents=True, exist_ok=True)
        self.refs: dict[str, tuple[bytes, ...]] = {}  # held sample id -> the hashes of its images stored here
        self.counts: Counter[bytes] = Counter()  # hash -> held samples referring to it
        self.freed_bytes = 0  # bytes of image files deleted since open

    def path(self, sha256: bytes) -> pathlib.Path:
        return self.directory / sha256.hex()

    # --- put ------------------------------------------------------------------------------------

    def strip(self, payload: bytes | memoryview, where: str, arriving: dict[bytes, bytes]) -> tuple[bytes, tuple[bytes, ...]]:
        """A serialized sample with images -> (its bytes without the images' bytes, the hashes it refers to). The
        bytes of images new to the store are added to `arriving` (hash -> bytes: written by `write`). CodecError
        (INVALID_ARGUMENT) names the image (`<where>.images[j]`) whose bytes do not match its hash, or that carries
        no bytes and is neither held nor arriving."""
        msg = common_pb2.Sample.FromString(payload)  # valid: intake's parse_sample read it
        hashes = []
        for j, image in enumerate(msg.images):
            if image.data:
                digest = hashlib.sha256(image.data).digest()
                if image.sha256 and image.sha256 != digest:
                    raise CodecError(f"{where}.images[{j}].sha256: does not match the SHA-256 of its data "
                                     f"({digest.hex()[:16]}...)")
                image.sha256 = digest
                if not self.counts[digest] and digest not in arriving:
                    arriving[digest] = image.data
                image.ClearField("data")
            elif not (image.sha256 and (self.counts[image.sha256] or image.sha256 in arriving)):
                raise CodecError(f"{where}.images[{j}]: no bytes, and the buffer holds no image with sha256 "
                                 f"{image.sha256.hex()[:16] or '(none)'}...: send the image's bytes")
            hashes.append(image.sha256)
        return msg.SerializeToString(), tuple(hashes)

    def write(self, sha256: bytes, data: bytes) -> None:
        """Store an image durably (under the fsync policy) before any record refers to it."""
        path = self.path(sha256)
        if path.exists():  # freed but not deleted yet, or left by a crash: the same bytes
            return
        tmp = path.with_name(path.name + _TMP_SUFFIX)
        with open(tmp, "wb") as file:
            file.write(data)
            if self.fsync:
                file.flush()
                os.fsync(file.fileno())
        os.replace(tmp, path)
        if self.fsync:
            fsync_dir(self.directory)

    # --- counting -------------------------------------------------------------------------------

    def hold(self, sample_id: str, hashes: tuple[bytes, ...]) -> None:
        """A held sample refers to these images (stored by hash)."""
        if hashes:
            self.refs[sample_id] = hashes
            self.counts.update(hashes)

    def release(self, sample_ids: list[str]) -> list[bytes]:
        """These samples are no longer held; returns the hashes no held sample refers to any more."""
        unused = []
        for sample_id in sample_ids:
            for sha256 in self.refs.pop(sample_id, ()):
                self.counts[sha256] -= 1
                if not self.counts[sha256]:
                    del self.counts[sha256]
                    unused.append(sha256)
        return unused

    def delete(self, hashes: list[bytes]) -> int:
        """Delete the files of these images unless a sample refers to one again; returns the bytes freed."""
        freed = 0
        for sha256 in hashes:
            if self.counts[sha256]:
                continue
            path = self.path(sha256)
            if path.exists():
                freed += path.stat().st_size
                path.unlink()
        if freed and self.fsync:
            fsync_dir(self.directory)
        self.freed_bytes += freed
        return freed

    def sweep(self) -> int:
        """Recovery: check every held sample's images are here, delete the files nobody refers to; returns the
        bytes freed."""
        missing = [sha256.hex() for sha256 in self.counts if not self.path(sha256).exists()]
        if missing:
            raise LogCorruption(f"{self.directory}: {len(missing)} images that held samples refer to are missing "
                                f"({', '.join(m[:16] for m in missing[:4])}...); the image store was damaged")
        held = {sha256.hex() for sha256 in self.counts}
        freed = 0
        for path in self.directory.iterdir():
            if path.name not in held:
                freed += path.stat().st_size
                path.unlink()
        self.freed_bytes += freed
        return freed

    # --- hand-out -------------------------------------------------------------------------------

    def inline(self, payload: bytes) -> bytes:
        """A stored sample with its images' bytes back in place (as the producer sent it, but re-encoded)."""
        msg = common_pb2.Sample.FromString(payload)
        for image in msg.images:
            if not image.data:
                image.data = self.path(image.sha256).read_bytes()
        return msg.SerializeToString()


def stored_hashes(images: list) -> tuple[bytes, ...]:
    """The hashes of a parsed sample's images that the store holds (logged without their bytes)."""
    return tuple(image.sha256 for image in images if not image.data)
