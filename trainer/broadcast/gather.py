"""A sharded policy published bucket by bucket: each tensor gathered on the trainer's device straight into its slot
of the bucket being sent, one bucket at a time, instead of a full state dict gathered into host memory first.

Under FSDP2 each parameter is a DTensor. One split evenly along its first dimension over one mesh dimension
(Shard(0), every other placement Replicate) is all-gathered straight into its slot; any other layout (an uneven
split, tensor-parallel placements) is gathered whole with `full_tensor()` and copied into its slot (one tensor's
extra memory). A tensor held whole (a world of one, buffers) is copied. Floating tensors are cast to the publish
dtype before the gather: the bytes gathered are the bytes sent.

Gathering is collective: every rank gathers every tensor, in one order (the manifest's: merge_order of the
names), by one method. Rank 0 does it inside the broadcaster's sender as the buckets go out (a bucket's memory,
twice: the sender's packing buffers); the other ranks in `finish()`, one tensor at a time. Rank 0 calls `finish()`
after its publish too: what a publish never reached (no receiver took it, a transfer failed) is gathered then,
so every rank has run the same collectives. Refused by every receiver at BeginUpdate, a publish gathers nothing,
and the same ShardedWeights may be published again (a version refused as not newer goes out once more).
"""

import contextlib
import threading
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from services.weights import Manifest, TransferError, merge_order

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def publish_dtype(name: str | None) -> torch.dtype | None:
    """The dtype a `publish.dtype` setting casts floating tensors to (None: sent as they are)."""
    return DTYPES[name] if name else None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _identity(tensor: torch.Tensor) -> tuple | None:
    """What two names of one tensor share, alike on every rank (a shard's storage, even when it holds no row of
    the tensor on this rank); None for a tensor without memory."""
    local = _local(tensor)
    storage = local.untyped_storage()
    if not storage.nbytes():
        return None
    return (local.device, storage.data_ptr(), local.storage_offset(), local.dtype, tuple(tensor.shape), local.stride())


def _even_shard_dim(tensor: DTensor) -> int | None:
    """The mesh dimension `tensor` is split evenly over along its dimension 0, when that is its only split."""
    shards = [i for i, p in enumerate(tensor.placements) if not p.is_replicate()]
    if len(shards) != 1:
        return None
    mesh_dim = shards[0]
    placement = tensor.placements[mesh_dim]
    if type(placement) is not Shard or placement.dim != 0 or tensor.shape[0] % tensor.device_mesh.size(mesh_dim):
        return None
    return mesh_dim


def gather_into(tensor: torch.Tensor, out: torch.Tensor) -> None:
    """The whole of `tensor` (a DTensor: collective) into `out` (its shape, the dtype it is sent in)."""
    if not isinstance(tensor, DTensor):
        out.copy_(tensor)
        return
    mesh_dim = _even_shard_dim(tensor)
    if mesh_dim is None:
        out.copy_((tensor.to(out.dtype) if tensor.dtype != out.dtype else tensor).full_tensor())
        return
    local = tensor.to_local().to(out.dtype).contiguous()
    dist.all_gather_into_tensor(out.view(-1), local.view(-1), group=tensor.device_mesh.get_group(mesh_dim))


class ShardedWeights:
    """The policy's tensors as this rank holds them (DTensor shards, or whole tensors), by Hugging Face name, to
    publish bucket by bucket (a services.weights.BucketSource). See the module docstring."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], device: torch.device | str,
                 dtype: torch.dtype | None = None):
        self.device = torch.device(device)
        self.dtype = dtype
        self._tensors: dict[str, torch.Tensor] = {}
        seen = set()
        for name, tensor in tensors.items():  # a tied model holds one tensor under two names: it goes once
            view = _identity(tensor)
            if view is not None and view in seen:
                continue
            seen.add(view)
            self._tensors[name] = tensor.detach()
        self._layout = merge_order((name, tuple(t.shape), self._sent_dtype(t)) for name, t in self._tensors.items())
        self._next = 0  # tensors gathered so far, in layout order
        self._lock = threading.Lock()
        self._scratch: torch.Tensor | None = None

    def layout(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, shape, dtype as sent) of every tensor, in the order they are gathered."""
        return list(self._layout)

    @property
    def gathered(self) -> int:
        """How many tensors were gathered so far."""
        return self._next

    def fill(self, manifest: Manifest, index: int, out: torch.Tensor) -> None:
        """Gather bucket `index`'s tensors into `out` (the BucketSource side, on rank 0)."""
        with torch.no_grad(), self._lock, self._on_device():
            slots = manifest.by_bucket[index]
            # A collective gathers on this rank's device: a bucket for another one (gloo from a GPU) is gathered there first.
            sharded = any(isinstance(self._tensors.get(slot.name), DTensor) for slot in slots)
            target = out if out.device == self.device or not sharded else self._scratch_for(out.numel())
            for slot in slots:
                self._expect(slot.name)
                view = target[slot.offset : slot.offset + slot.nbytes].view(slot.dtype).view(slot.shape)
                gather_into(self._tensors[slot.name], view)
                self._next += 1
            if target is not out:
                out.copy_(target)

    def finish(self) -> None:
        """Gather every tensor not gathered yet, and drop it (collective: every rank calls it once per publish)."""
        with torch.no_grad(), self._lock, self._on_device():
            for name, shape, dtype in self._layout[self._next :]:
                tensor = self._tensors[name]
                if isinstance(tensor, DTensor):
                    gather_into(tensor, torch.empty(shape, dtype=dtype, device=self.device))
                self._next += 1
            self._scratch = None

    def gathered_copy(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """Every tensor gathered now into tensors of its own on the device, by name ({} without `keep`, as on
        ranks other than 0): for a publish sent while the next step changes the parameters (collective)."""
        copies = {}
        with torch.no_grad(), self._lock, self._on_device():
            for name, shape, dtype in self._layout[self._next :]:
                tensor = self._tensors[name]
                if keep or isinstance(tensor, DTensor):
                    copy = torch.empty(shape, dtype=dtype, device=self.device)
                    gather_into(tensor, copy)
                    if keep:
                        copies[name] = copy
                self._next += 1
        return copies

    def _expect(self, name: str) -> None:
        expected = self._layout[self._next][0] if self._next < len(self._layout) else None
        if name != expected:
            raise TransferError(f"gathering {name!r} out of order: {self._next} of {len(self._layout)} tensors "
                                f"gathered, the next is {expected!r} (a publish of weights already gathered?)")

    def _sent_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype

    def _scratch_for(self, nbytes: int) -> torch.Tensor:
        """A bucket's bytes on this rank's device (kept for the next bucket)."""
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._scratch[:nbytes]

    def _on_device(self):
        # The sender's thread starts on cuda:0, whatever this rank's GPU: its collectives and copies must not.
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()


def finish_gather(tensors: object) -> None:
    """ShardedWeights.finish when `tensors` are sharded weights; nothing for a plain mapping."""
    if isinstance(tensors, ShardedWeights):
        tensors.finish()
