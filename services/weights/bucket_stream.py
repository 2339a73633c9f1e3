"""Send and receive every bucket of a manifest over a formed group, under one deadline."""

import threading
from collections import deque
from collections.abc import Mapping

import torch

from services.weights.buckets import as_bytes, pack_bucket
from services.weights.manifest import Manifest
from services.weights.transfer import Pending, Transfer, TransferError

# Broadcasts in flight at once on the sender: hides each collective's start-up cost and lets packing
# of the next bucket overlap the wire.
SEND_DEPTH = 4
# Packing buffers, reused round-robin; a buffer is refilled only after its broadcast completed.
PACK_BUFFERS = 2


def _direct_source(manifest: Manifest, index: int, tensors: Mapping[str, torch.Tensor],
                   device: torch.device) -> torch.Tensor | None:
    """A bucket that is exactly one contiguous tensor already on `device` is sent from that tensor."""
    group = manifest.by_bucket[index]
    if len(group) != 1:
        return None
    tensor = tensors[group[0].name].detach()
    if tensor.device != device or not tensor.is_contiguous():
        return None
    if tuple(tensor.shape) != group[0].shape or tensor.dtype != group[0].dtype:
        raise ValueError(f"tensor {group[0].name!r}: got {tuple(tensor.shape)} {tensor.dtype}, the manifest "
                         f"says {group[0].shape} {group[0].dtype}")
    return as_bytes(tensor)


class BucketSender:
    """Rank 0's side of the bucket stream. Keeps its packing buffers from one update to the next."""

    def __init__(self, depth: int = SEND_DEPTH):
        self.depth = depth
        self._buffers: list[torch.Tensor] = []

    @torch.no_grad()
    def send(self, transfer: Transfer, manifest: Manifest, tensors: Mapping[str, torch.Tensor],
             deadline: float) -> None:
        """Broadcast every bucket in manifest order; return once all are sent.

        A bucket holding one tensor goes straight from that tensor's memory; the others are packed
        into reusable buffers while earlier buckets are on the wire.
        """
        missing = [slot.name for slot in manifest.slots if slot.name not in tensors]
        if missing:
            raise ValueError(f"tensors missing from the update: {', '.join(missing[:5])}")
        device = transfer.device
        in_flight: deque[tuple[Pending, int | None]] = deque()
        turn = 0
        for index, size in enumerate(manifest.bucket_sizes):
            if size == 0:
                continue
            source = _direct_source(manifest, index, tensors, device)
            buffer_index = None
            if source is None:
                buffer_index, turn = turn, (turn + 1) % PACK_BUFFERS
                while any(used == buffer_index for _, used in in_flight):
                    in_flight.popleft()[0].wait(deadline)
                source = pack_bucket(manifest, index, tensors, out=self._buffer(buffer_index, size, device))
            while len(in_flight) >= self.depth:
                in_flight.popleft()[0].wait(deadline)
            in_flight.append((transfer.broadcast(source), buffer_index))
        while in_flight:
            in_flight.popleft()[0].wait(deadline)

    def _buffer(self, index: int, size: int, device: torch.device) -> torch.Tensor:
        while len(self._buffers) <= index:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=device))
        if self._buffers[index].numel() < size or self._buffers[index].device != device:
            self._buffers[index] = torch.empty(size, dtype=torch.uint8, device=device)
        return self._buffers[index]


def send_buckets(transfer: Transfer, manifest: Manifest, tensors: Mapping[str, torch.Tensor], deadline: float) -> None:
    """Broadcast every bucket once, with fresh packing buffers (see BucketSender to keep them)."""
    BucketSender().send(transfer, manifest, tensors, deadline)


def allocate_staging(manifest: Manifest, device: torch.device) -> list[torch.Tensor]:
    """One uint8 buffer per bucket, where a receiver lands the broadcast."""
    return [torch.empty(size, dtype=torch.uint8, device=device) for size in manifest.bucket_sizes]


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
