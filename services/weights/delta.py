"""Partial weight updates: how each bucket of a version travels as a change of its base version, and the checksum
that proves a receiver's bucket equals the sender's once applied. The trainer encodes (encode_bucket), the rollout
worker applies and verifies (receive_parts); pure tensor code over a Transfer, no gRPC.

A bucket travels WHOLE (its bytes), as a DELTA (the positions of the words that changed since the base, then their
new values: a word is the smallest element size among the bucket's tensors, so bfloat16 buckets diff by 2-byte
words, bit for bit) or not at all (UNCHANGED); encode_bucket picks the smallest. Lossless: the receiver's bytes are
the sender's, which bucket_checksum (CRC-32) checks for every bucket of every version. A version's parts may come from
several senders (each part names its own; receive_parts takes each sender's on that sender's group).
"""

import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from protos import weights_pb2
from protos.codec import CodecError
from services.weights.manifest import Manifest, TensorSlot, aligned
from services.weights.transfer import Transfer, TransferError

WHOLE, DELTA, UNCHANGED = weights_pb2.BUCKET_WHOLE, weights_pb2.BUCKET_DELTA, weights_pb2.BUCKET_UNCHANGED
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ChecksumMismatch(TransferError):
    """A bucket's bytes after applying its part do not hash to what the sender said: the receiver needs a full send."""


@dataclass(frozen=True)
class BucketPart:
    """One bucket of a version on the wire (the proto's BucketPart)."""

    bucket: int
    encoding: int
    wire_bytes: int
    words: int = 0
    sender: int = 0
    checksum: int = 0

    def to_proto(self) -> weights_pb2.BucketPart:
        return weights_pb2.BucketPart(bucket=self.bucket, encoding=self.encoding, wire_bytes=self.wire_bytes,
                                      words=self.words, sender=self.sender, checksum=self.checksum)

    @classmethod
    def from_proto(cls, msg: weights_pb2.BucketPart) -> "BucketPart":
        return cls(msg.bucket, msg.encoding, msg.wire_bytes, msg.words, msg.sender, msg.checksum)


def word_dtype(manifest: Manifest, index: int) -> torch.dtype:
    """The word a bucket is diffed and hashed by: its smallest element size (every slot is a multiple of it)."""
    return _WORDS[min(slot.dtype.itemsize for slot in manifest.by_bucket[index])]


def _position_dtype(bucket_words: int) -> torch.dtype:
    return torch.int32 if bucket_words < (1 << 31) else torch.int64


def _delta_layout(bucket_bytes: int, word: torch.dtype, count: int) -> tuple[torch.dtype, int, int]:
    """(position dtype, where the values start, wire bytes) of a delta of `count` words."""
    positions = _position_dtype(bucket_bytes // word.itemsize)
    values_at = aligned(count * positions.itemsize)
    return positions, values_at, values_at + count * word.itemsize


def bucket_checksum(bucket: torch.Tensor) -> int:
    """CRC-32 of the bucket's bytes (never 0; zlib's runs at several GB/s). A CUDA bucket is hashed from a host copy."""
    return zlib.crc32(bucket.detach().cpu().numpy()) or 1


@torch.no_grad()
def encode_bucket(index: int, current: torch.Tensor, base: torch.Tensor | None, word: torch.dtype
                  ) -> tuple[BucketPart, torch.Tensor | None]:
    """The part (and the bytes to broadcast, None when nothing changed) that turns `base` into `current`, both
    uint8 buckets of the same layout; WHOLE when there is no base or the delta would not be smaller."""
    checksum = bucket_checksum(current)
    if base is None:
        return BucketPart(index, WHOLE, current.numel(), checksum=checksum), current
    now = current.view(word)
    changed = (now != base.view(word)).nonzero().flatten()
    count = changed.numel()
    if count == 0:
        return BucketPart(index, UNCHANGED, 0, checksum=checksum), None
    positions, values_at, wire_bytes = _delta_layout(current.numel(), word, count)
    if wire_bytes >= current.numel():
        return BucketPart(index, WHOLE, current.numel(), checksum=checksum), current
    wire = torch.empty(wire_bytes, dtype=torch.uint8, device=current.device)
    wire[: count * positions.itemsize].view(positions).copy_(changed)
    wire[values_at:].view(word).copy_(now[changed])
    return BucketPart(index, DELTA, wire_bytes, count, checksum=checksum), wire


def wire_manifest(parts: Sequence[BucketPart]) -> Manifest:
    """What goes over the group: one uint8 bucket per part that carries bytes, in bucket order."""
    sent = [part for part in parts if part.wire_bytes]
    slots = tuple(TensorSlot(f"part.{part.bucket}", (part.wire_bytes,), torch.uint8, index, 0)
                  for index, part in enumerate(sent))
    return Manifest(slots, tuple(part.wire_bytes for part in sent))


def parse_parts(manifest: Manifest, protos: Sequence[weights_pb2.BucketPart], senders: int = 1
                ) -> tuple[BucketPart, ...]:
    """The request's parts, checked against its manifest (one per bucket, in order, sizes consistent, each from one
    of the update's `senders`, every sender owning at least one bucket); CodecError."""
    parts = tuple(BucketPart.from_proto(msg) for msg in protos)
    if not parts:
        if senders > 1:
            raise CodecError(f"parts: {senders} senders named (sender_groups) but no parts say which buckets are theirs")
        return parts
    if [part.bucket for part in parts] != list(range(len(manifest.bucket_sizes))):
        raise CodecError(f"parts: one per bucket in bucket order, got buckets {[p.bucket for p in parts][:8]}")
    for part in parts:
        size = manifest.bucket_sizes[part.bucket]
        if part.sender >= senders:
            raise CodecError(f"parts: bucket {part.bucket} from sender {part.sender}, but the update names {senders} "
                             "sender(s) (group and sender_groups)")
        if part.encoding == WHOLE:
            expected = size
        elif part.encoding == DELTA:
            expected = _delta_layout(size, word_dtype(manifest, part.bucket), part.words)[2]
        elif part.encoding == UNCHANGED:
            expected = 0
        else:
            raise CodecError(f"parts: bucket {part.bucket}: unknown encoding {part.encoding}")
        if part.wire_bytes != expected:
            raise CodecError(f"parts: bucket {part.bucket}: {part.wire_bytes} wire bytes, its encoding needs {expected}")
    idle = sorted(set(range(senders)) - {part.sender for part in parts})
    if idle:
        raise CodecError(f"parts: sender(s) {idle} named but owning no bucket")
    return parts


@torch.no_grad()
def receive_parts(transfer: Transfer | Callable[[int], Transfer], manifest: Manifest, parts: Sequence[BucketPart],
                  deadline: float, staging: list[torch.Tensor], base: list[torch.Tensor] | None,
                  cancelled: threading.Event | None = None) -> None:
    """Land a version sent as `parts` in `staging`: whole buckets straight into it, the others as `base`'s bucket
    (staging itself when None) patched by their delta; then verify every checksum (ChecksumMismatch).

    `transfer`: the group of the one sender, or `sender -> its group` (joining it) for several: sender by sender,
    each one's receives are posted as soon as its group is formed, before the next group is joined, so a sender
    that never comes holds up no other one. A part that has not arrived by `deadline` raises a TransferError that
    names its sender and buckets."""
    join = transfer if callable(transfer) else (lambda sender: transfer)
    pending, deltas = [], []
    for sender in sorted({part.sender for part in parts}):
        mine = [part for part in parts if part.sender == sender]
        try:
            group = join(sender)
        except TransferError as exc:
            raise _missing(sender, mine, f"its group did not form ({exc})") from exc
        for part in mine:
            target = staging[part.bucket]
            if part.encoding != WHOLE and base is not None and base[part.bucket] is not target:
                target.copy_(base[part.bucket])
            if part.encoding == WHOLE:
                pending.append((sender, mine, group.broadcast(target)))
            elif part.encoding == DELTA:
                wire = torch.empty(part.wire_bytes, dtype=torch.uint8, device=group.device)
                pending.append((sender, mine, group.broadcast(wire)))
                deltas.append((part, wire))
    for sender, mine, work in pending:
        if cancelled is not None and cancelled.is_set():
            raise TransferError("update aborted while receiving")
        try:
            work.wait(deadline)
        except TransferError as exc:
            raise _missing(sender, mine, str(exc)) from exc
    for part, wire in deltas:
        word = word_dtype(manifest, part.bucket)
        positions, values_at, _ = _delta_layout(manifest.bucket_sizes[part.bucket], word, part.words)
        wire = wire.to(staging[part.bucket].device)
        at = wire[: part.words * positions.itemsize].view(positions).to(torch.int64)
        staging[part.bucket].view(word)[at] = wire[values_at:].view(word)
    for part in parts:
        if part.checksum and bucket_checksum(staging[part.bucket]) != part.checksum:
            raise ChecksumMismatch(f"bucket {part.bucket}: checksum mismatch after its {part.encoding} part")


def _missing(sender: int, parts: Sequence[BucketPart], why: str) -> TransferError:
    buckets = [part.bucket for part in parts if part.wire_bytes]
    shown = f"{buckets[0]}..{buckets[-1]}" if len(buckets) > 3 else ", ".join(map(str, buckets))
    return TransferError(f"the part of sender {sender} (bucket(s) {shown}) did not all arrive: {why}")
