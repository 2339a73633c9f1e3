"""Send and receive every bucket of a manifest over a formed group, under one deadline."""

import threading
from collections import deque
from collections.abc import Mapping
from typing import Protocol

import torch

from services.weights.buckets import pack_bucket, unpack_buckets
from services.weights.manifest import Manifest, aligned
from services.weights.transfer import Pending, Transfer, TransferError

# Broadcasts in flight at once on the sender: hides each collective's start-up cost and lets packing
# of the next bucket overlap the wire.
SEND_DEPTH = 4
# Packing buffers, reused round-robin; a buffer is refilled only after its broadcast completed.
PACK_BUFFERS = 2


class BucketSource(Protocol):
    """Tensors that fill each bucket themselves instead of being packed from a mapping: a sharded model gathers
    each bucket's tensors on its device straight into the bucket (trainer/broadcast/gather.py)."""

    device: torch.device  # where the tensors are (a bucket on another device is filled through a copy)

    def fill(self, manifest: Manifest, index: int, out: torch.Tensor) -> None:
        """Write bucket `index`'s tensors into `out` (uint8, the bucket's size) at their slots' offsets."""
        ...


def _direct_source(manifest: Manifest, index: int, tensors: Mapping[str, torch.Tensor],
                   device: torch.device) -> torch.Tensor | None:
    """Bucket `index`'s bytes straight from the tensors' memory, when they already lie there as the bucket
    lays them out (one tensor alone, or tensors bound to the bucket layout: see bind_to_buckets); else None."""
    group = manifest.by_bucket[index]
    first = tensors[group[0].name]
    if first.device != device:
        return None
    storage = first.untyped_storage()
    start = first.data_ptr() - group[0].offset
    for slot in group:
        tensor = tensors[slot.name]
        if (tensor.data_ptr() != start + slot.offset or not tensor.is_contiguous() or tensor.dtype != slot.dtype
                or tuple(tensor.shape) != slot.shape or tensor.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
    offset = start - storage.data_ptr()
    if offset < 0 or offset + manifest.bucket_sizes[index] > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, offset, (manifest.bucket_sizes[index],))


def bind_to_buckets(parameters: Mapping[str, torch.Tensor], manifest: Manifest) -> list[torch.Tensor]:
    """Move `parameters` into one buffer laid out as `manifest`'s buckets (values kept, `.data` re-pointed).

    Tensors updated in place afterwards (an optimizer step) stay there, and every bucket is broadcast
    straight from their memory, with no packing copy. Returns the buffers (the tensors' memory now).
    """
    device = parameters[manifest.slots[0].name].device
    buffers = allocate_staging(manifest, device)
    with torch.no_grad():
        for name, view in unpack_buckets(manifest, buffers).items():
            view.copy_(parameters[name])
            parameters[name].data = view
    return buffers


class BucketSender:
    """Rank 0's side of the bucket stream. Keeps its packing buffers from one update to the next."""

    def __init__(self, depth: int = SEND_DEPTH):
        self.depth = depth
        self._buffers: list[torch.Tensor] = []

    @torch.no_grad()
    def send(self, transfer: Transfer, manifest: Manifest, tensors: Mapping[str, torch.Tensor] | BucketSource,
             deadline: float) -> None:
        """Broadcast every bucket in manifest order; return once all are sent.

        A bucket whose tensors already lie in memory as it lays them out (one tensor alone, or tensors
        bound with bind_to_buckets) goes straight from that memory; the others are packed into reusable
        buffers while earlier buckets are on the wire. A BucketSource fills those buffers itself, bucket by
        bucket, as they go out.
        """
        source = None if isinstance(tensors, Mapping) else tensors
        missing = [] if source is not None else [slot.name for slot in manifest.slots if slot.name not in tensors]
        if missing:
            raise ValueError(f"tensors missing from the update: {', '.join(missing[:5])}")
        device = transfer.device
        in_flight: deque[tuple[Pending, int | None]] = deque()
        turn = 0
        for index, size in enumerate(manifest.bucket_sizes):
            if size == 0:
                continue
            bucket = None if source is not None else _direct_source(manifest, index, tensors, device)
            buffer_index = None
            if bucket is None:
                buffer_index, turn = turn, (turn + 1) % PACK_BUFFERS
                while any(used == buffer_index for _, used in in_flight):
                    in_flight.popleft()[0].wait(deadline)
                out = self._buffer(buffer_index, size, device)
                if source is None:
                    bucket = pack_bucket(manifest, index, tensors, out=out)
                else:
                    bucket = out[:size]
                    source.fill(manifest, index, bucket)
            while len(in_flight) >= self.depth:
                in_flight.popleft()[0].wait(deadline)
            in_flight.append((transfer.broadcast(bucket), buffer_index))
        while in_flight:
            in_flight.popleft()[0].wait(deadline)

    def _buffer(self, index: int, size: int, device: torch.device) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self._buffers[index].numel() < size or self._buffers[index].device != device:
            self._buffers[index] = torch.empty(size, dtype=torch.uint8, device=device)
        return self._buffers[index]


@torch.no_grad()
def send_tensors(transfer: Transfer, manifest: Manifest, tensors: Mapping[str, torch.Tensor], deadline: float,
                 depth: int = SEND_DEPTH) -> None:
    """Broadcast every tensor of the manifest on its own, in slot order, in its shape and dtype (no bucket
    layout): what a member that receives tensor by tensor posts (SGLang's update_weights_from_distributed)."""
    in_flight: deque[Pending] = deque()
    for slot in manifest.slots:
        tensor = tensors[slot.name]
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise ValueError(f"tensor {slot.name!r}: got {tuple(tensor.shape)} {tensor.dtype}, the manifest says "
                             f"{slot.shape} {slot.dtype}")
        while len(in_flight) >= depth:
            in_flight.popleft().wait(deadline)
        in_flight.append(transfer.broadcast(tensor.to(transfer.device).contiguous()))
    while in_flight:
        in_flight.popleft().wait(deadline)


def send_buckets(transfer: Transfer, manifest: Manifest, tensors: Mapping[str, torch.Tensor], deadline: float) -> None:
    """Broadcast every bucket once, with fresh packing buffers (see BucketSender to keep them)."""
    BucketSender().send(transfer, manifest, tensors, deadline)


def allocate_staging(manifest: Manifest, device: torch.device) -> list[torch.Tensor]:
    """One uint8 buffer per bucket, where a receiver lands the broadcast.

    The buffers are slices of one allocation, back to back at aligned offsets: tensors sent one after
    the other stay adjacent in memory across bucket boundaries, so an engine can serve merged
    projections (q/k/v, gate/up) straight from the staged bytes.
    """
    starts, end = [], 0
    for size in manifest.bucket_sizes:
        starts.append(aligned(end))
        end = starts[-1] + size
    arena = torch.empty(end, dtype=torch.uint8, device=device)
    return [arena[start : start + size] for start, size in zip(starts, manifest.bucket_sizes, strict=True)]


def receive_buckets(
    transfer: Transfer,
    manifest: Manifest,
    deadline: float,
    staging: list[torch.Tensor],
    cancelled: threading.Event | None = None,
) -> None:
    """Receive every bucket into `staging` (one buffer per bucket, see allocate_staging).

    All receives are posted at once so the backend never waits on Python between buckets.
    """
    if [t.numel() for t in staging] != list(manifest.bucket_sizes):
        raise ValueError("staging buffers do not match the manifest's bucket sizes")
    pending = [transfer.broadcast(buffer) for buffer in staging if buffer.numel() > 0]
    for work in pending:
        if cancelled is not None and cancelled.is_set():
            raise TransferError("update aborted while receiving")
        work.wait(deadline)
