"""Weight transfer through CUDA IPC handles, for receivers on the trainer's own GPU: no copy through host memory
(gloo) and none through NCCL, which refuses two ranks on one GPU.

Chosen, not configured (services/weights/backends.py): every member of a weight-update group checks in with the
device it stages on (host + GPU UUID, the same for two processes that see one GPU under different indices), and
when every receiver is on rank 0's GPU the group is formed as this backend, whatever backend its spec names. The
choice (`choose_backend`) reads only those identities, so every member makes the same one, and it is tested on CPU.

Rank 0 shares each bucket as it would broadcast it: `torch.multiprocessing.reductions.reduce_tensor` gives the
CUDA IPC handle of the bucket's allocation, its offset, and an IPC event recorded after the writes that filled it;
the handle travels through the group's store (msgpack; the device as its GPU UUID, which each receiver maps to
its own index). Each receiver opens it (`rebuild_cuda_tensor`: its stream waits on the event), copies the bucket
into its staging buffer on the same GPU, waits for the copy, drops the mapping and says so on the store; rank 0's
broadcast is done once every receiver has, and only then is the bucket's memory reused. Every wait keeps its
deadline. Runs only where CUDA is (and IPC between the processes is allowed: same host, same IPC namespace):
tests/test_weight_sync_ipc.py, marker `gpu`; its store protocol runs on CPU with in-process handles.
"""

import datetime
import sys
import time
from collections.abc import Sequence
from typing import Protocol

import msgpack
import torch
import torch.distributed as dist

from services.weights.transfer import GroupSpec, Pending, Transfer, TransferError, TransferTimeout, remaining

IPC = "cuda_ipc"
_POLL_S = 0.0005


def choose_backend(backend: str, identities: Sequence[str], ipc_allowed: bool) -> str:
    """The backend a weight-update group is formed with: `identities[r]` is member r's device (rank 0: the trainer;
    `<host>/GPU-<uuid>` or `<host>/cpu`). CUDA IPC when rank 0 allows it and is on a GPU that every receiver
    stages on; otherwise `backend` as configured (where NCCL refuses members that share a GPU). A group configured
    as cuda_ipc whose receivers are not all on the trainer's GPU is refused (TransferError)."""
    trainer, receivers = identities[0], identities[1:]
    shares = "/GPU-" in trainer and all(identity == trainer for identity in receivers)
    if shares and ipc_allowed:
        return IPC
    if backend == IPC:
        elsewhere = [f"rank {rank}: {identity}" for rank, identity in enumerate(receivers, start=1) if identity != trainer]
        why = ", ".join(elsewhere) if elsewhere else "CUDA IPC is turned off or impossible on this platform"
        raise TransferError(f"backend {IPC!r} needs every receiver on the trainer's GPU ({trainer}): {why}")
    return backend


def ipc_possible(device: torch.device | None) -> bool:
    """Whether this process could share CUDA memory through IPC handles from `device`."""
    return device is not None and device.type == "cuda" and sys.platform.startswith("linux")


class Handles(Protocol):
    """How a bucket's memory is named to another process, and copied from that name."""

    def share(self, bucket: torch.Tensor) -> bytes:
        """A name for `bucket`'s memory that another process can open."""
        ...

    def copy_into(self, out: torch.Tensor, payload: bytes) -> None:
        """Open `payload`, copy its bytes into `out`, and return once the copy is done and the name is closed."""
        ...


class CudaHandles:
    """CUDA IPC handles of torch's caching allocator (torch.multiprocessing.reductions)."""

    def share(self, bucket: torch.Tensor) -> bytes:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

        rebuild, args = reduce_tensor(bucket)
        if rebuild is not rebuild_cuda_tensor or args[0] is not torch.Tensor or args[4] is not torch.storage.TypedStorage:
            raise TransferError(f"CUDA IPC shares a plain CUDA tensor, not {type(bucket).__name__} on {bucket.device}")
        return encode_handle(args, str(torch.cuda.get_device_properties(args[6]).uuid))

    def copy_into(self, out: torch.Tensor, payload: bytes) -> None:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = decode_handle(payload, local_gpus())
        with torch.cuda.device(out.device):
            remote = rebuild_cuda_tensor(*args)  # this device's current stream waits for the sender's writes
            out.copy_(remote.view(-1))
            torch.cuda.current_stream(out.device).synchronize()
        del remote  # closes the mapping and releases the sender's reference


def local_gpus() -> dict[str, int]:
    """GPU UUID -> this process's index of it."""
    return {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}


# reduce_tensor's rebuild arguments for a CUDA tensor, in order (a signature torch has kept for years).
_FIELDS = ("tensor_cls", "size", "stride", "offset", "storage_cls", "dtype", "device", "handle", "storage_size",
           "storage_offset", "requires_grad", "ref_counter_handle", "ref_counter_offset", "event_handle",
           "event_sync_required")


def encode_handle(args: Sequence, gpu_uuid: str) -> bytes:
    """reduce_tensor's arguments for a uint8 bucket as msgpack, the device as its GPU UUID (no pickle on the wire)."""
    fields = dict(zip(_FIELDS, args, strict=True))
    if fields["dtype"] != torch.uint8:
        raise TransferError(f"CUDA IPC carries uint8 buckets, not {fields['dtype']}")
    fields.update(size=list(fields["size"]), stride=list(fields["stride"]), device=gpu_uuid)
    for name in ("tensor_cls", "storage_cls", "dtype", "requires_grad"):
        del fields[name]
    return msgpack.packb(fields)


def decode_handle(payload: bytes, gpus: dict[str, int]) -> tuple:
    """rebuild_cuda_tensor's arguments from encode_handle's bytes, on this process's index of the sender's GPU."""
    fields = msgpack.unpackb(payload)
    if fields["device"] not in gpus:
        raise TransferError(f"CUDA IPC: the trainer's GPU {fields['device']} is not visible to this process "
                            f"(it sees {', '.join(gpus) or 'none'})")
    fields.update(tensor_cls=torch.Tensor, storage_cls=torch.storage.TypedStorage, dtype=torch.uint8,
                  requires_grad=False, size=torch.Size(fields["size"]), stride=tuple(fields["stride"]),
                  device=gpus[fields["device"]])
    return tuple(fields[name] for name in _FIELDS)


class _Shared(Pending):
    """Rank 0: one bucket shared; done once every receiver copied it."""

    def __init__(self, store: dist.Store, key: str, receivers: int):
        self.store, self.key, self.receivers = store, key, receivers

    def wait(self, deadline: float) -> None:
        while (copied := self.store.add(f"{self.key}/copied", 0)) < self.receivers:
            if time.monotonic() > deadline:
                raise TransferTimeout(f"{self.key}: {copied} of {self.receivers} receivers copied it by the deadline")
            time.sleep(_POLL_S)
        self.store.delete_key(self.key)
        self.store.delete_key(f"{self.key}/copied")


class _Received(Pending):
    """A receiver: one bucket to copy from rank 0's memory, once its handle is on the store."""

    def __init__(self, transfer: "CudaIpcTransfer", key: str, out: torch.Tensor):
        self.transfer, self.key, self.out = transfer, key, out

    def wait(self, deadline: float) -> None:
        store = self.transfer.store
        try:
            store.wait([self.key], datetime.timedelta(seconds=remaining(deadline, f"{self.key}: handle")))
        except (RuntimeError, dist.DistStoreError) as exc:
            raise TransferTimeout(f"{self.key}: no handle from the trainer by the deadline ({exc})") from exc
        try:
            self.transfer.handles.copy_into(self.out, store.get(self.key))
        except RuntimeError as exc:
            raise TransferError(f"{self.key}: copying from the trainer's GPU memory failed: {exc}") from exc
        store.add(f"{self.key}/copied", 1)


class CudaIpcTransfer(Transfer):
    """Rank `spec.rank` of a group whose members all stage on one GPU: rank 0 shares each bucket's memory, the
    others copy it (see the module docstring). `handles`: CudaHandles, or another naming of memory in tests."""

    def __init__(self, spec: GroupSpec, store: dist.Store, device: torch.device, handles: Handles | None = None):
        super().__init__(spec)
        self.store = store
        self.handles = handles if handles is not None else CudaHandles()
        self._device = device
        self._sent = 0  # buckets so far: both sides count them alike, which names each one's key
        self._released = False

    @property
    def device(self) -> torch.device:
        return self._device

    def broadcast(self, tensor: torch.Tensor) -> Pending:
        if self._released:
            raise TransferError(f"group {self.spec.group_name} was released")
        if tensor.device != self._device or tensor.dtype != torch.uint8 or not tensor.is_contiguous():
            raise TransferError(f"group {self.spec.group_name}: a bucket must be contiguous uint8 on {self._device}, "
                                f"got {tensor.dtype} on {tensor.device}")
        key = f"ipc/{self._sent}"
        self._sent += 1
        if self.spec.rank != 0:
            return _Received(self, key, tensor)
        try:
            self.store.set(key, self.handles.share(tensor))
        except RuntimeError as exc:
            raise TransferError(f"rank 0 could not share {key}: {exc}") from exc
        return _Shared(self.store, key, self.spec.world_size - 1)

    def _release(self) -> None:
        self._released = True
