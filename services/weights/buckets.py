"""Buckets: flat uint8 tensors that carry several named tensors, packed by the sender, viewed by receivers."""

from collections.abc import Mapping

import torch

from services.weights.manifest import Manifest


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def pack_bucket(
    manifest: Manifest, index: int, tensors: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy the tensors of bucket `index` into a flat uint8 tensor (`out` if given, reused across buckets).

    Each tensor must match its slot's shape and dtype; the padding between slots is zeroed, so a bucket's bytes (and
    its checksum: services/weights/delta.py) are the same whichever buffer it was packed into.
    """
    size = manifest.bucket_sizes[index]
    if out is None:
        first = manifest.by_bucket[index][0].name
        out = torch.empty(size, dtype=torch.uint8, device=tensors[first].device)
    bucket = out[:size]
    end = 0
    for slot in manifest.by_bucket[index]:
        if slot.offset > end:
            bucket[end : slot.offset].zero_()
        end = slot.offset + slot.nbytes
        tensor = tensors[slot.name]
        if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
            raise ValueError(
                f"tensor {slot.name!r}: got {tuple(tensor.shape)} {tensor.dtype}, the manifest says "
                f"{slot.shape} {slot.dtype}"
            )
        bucket[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape).copy_(tensor)
    return bucket


def unpack_bucket(manifest: Manifest, index: int, bucket: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views (no copy) of bucket `index`'s tensors, by name."""
    if bucket.dtype != torch.uint8 or bucket.numel() != manifest.bucket_sizes[index]:
        raise ValueError(
            f"bucket {index}: expected {manifest.bucket_sizes[index]} uint8 bytes, got {bucket.numel()} {bucket.dtype}"
        )
    return {
        slot.name: bucket[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
        for slot in manifest.by_bucket[index]
    }


def unpack_buckets(manifest: Manifest, buckets: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Views (no copy) of every tensor of the manifest, by name; `buckets[i]` holds bucket i."""
    views: dict[str, torch.Tensor] = {}
    for index, bucket in enumerate(buckets):
        views.update(unpack_bucket(manifest, index, bucket))
    return views
