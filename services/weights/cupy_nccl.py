"""Weight transfer over NCCL through cupy's bindings (`cupy.cuda.nccl`, the `gpu` extra): the same protocol
as nccl.py without a torch ProcessGroup, the way engines that keep torch.distributed for themselves (vLLM's
pynccl, veRL) receive weights.

Each member names its CUDA device (transfer.transfer_device). After every member checked in
(backends.make_group, nccl_rendezvous.py), rank 0 makes the NCCL unique id and hands it to the others over the group's TCP store,
and every member creates its communicator at once, on its device, within the rendezvous deadline. Buckets
are broadcast on a stream of this transfer's own that first waits for the device's current stream (where
the bucket was packed or allocated); a CUDA event recorded after each broadcast tells the host when it is
done, so every wait keeps its deadline. cupy finds libnccl through torch, which loads it first.
Runs only where CUDA is: tests/test_weight_sync_nccl.py (marker `gpu`).
"""

import datetime
import struct
import time

import torch
import torch.distributed as dist

from services.weights.nccl_rendezvous import within
from services.weights.transfer import (
    GroupSpec,
    Pending,
    Transfer,
    TransferError,
    TransferTimeout,
    deadline_after,
    remaining,
)

_POLL_S = 0.0005
_UNIQUE_ID = "cupy-nccl-unique-id"


def _nccl():
    """cupy's NCCL module, or TransferError saying what is missing."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise TransferError(f"backend 'cupy_nccl' needs cupy: pip install 'relayrl[gpu]' ({exc})") from exc
    if not getattr(nccl, "available", True):
        raise TransferError("backend 'cupy_nccl': cupy was built without NCCL (cupy.cuda.nccl.available is False)")
    return nccl


def _share_unique_id(store: dist.Store, spec: GroupSpec, nccl, deadline: float) -> tuple[int, ...]:
    """Rank 0's NCCL unique id (128 signed chars, as cupy gives it), on every member, through the store."""
    if spec.rank == 0:
        unique_id = nccl.get_unique_id()
        store.set(_UNIQUE_ID, struct.pack(f"{len(unique_id)}b", *unique_id))
        return unique_id
    store.wait([_UNIQUE_ID], datetime.timedelta(seconds=remaining(deadline, f"group {spec.group_name}: unique id")))
    raw = store.get(_UNIQUE_ID)
    return struct.unpack(f"{len(raw)}b", raw)


class _CupyPending(Pending):
    def __init__(self, done: torch.cuda.Event, comm, nccl_error: type[Exception], rank: int):
        self.done = done
        self.comm = comm
        self.nccl_error = nccl_error
        self.rank = rank

    def wait(self, deadline: float) -> None:
        while not self.done.query():
            try:
                self.comm.check_async_error()
            except self.nccl_error as exc:
                raise TransferError(f"rank {self.rank} NCCL broadcast failed: {exc}") from exc
            if time.monotonic() > deadline:
                raise TransferTimeout(f"rank {self.rank} NCCL broadcast: deadline passed")
            time.sleep(_POLL_S)


class CupyNcclTransfer(Transfer):
    """A cupy NcclCommunicator on `device` (one rank per member, one GPU per rank)."""

    def __init__(self, spec: GroupSpec, store: dist.Store, timeout_s: float, device: torch.device):
        super().__init__(spec)
        self._nccl = _nccl()
        import cupy

        self._device = device
        deadline = deadline_after(timeout_s)
        unique_id = _share_unique_id(store, spec, self._nccl, deadline)

        def create():
            with cupy.cuda.Device(device.index):
                return self._nccl.NcclCommunicator(spec.world_size, unique_id, spec.rank)

        self.comm = within(deadline, f"group {spec.group_name}: NCCL communicator on {device}", create)
        self._stream = torch.cuda.Stream(device)

    @property
    def device(self) -> torch.device:
        return self._device

    def broadcast(self, tensor: torch.Tensor) -> Pending:
        comm = self.comm
        if comm is None:
            raise TransferError(f"group {self.spec.group_name} was released")
        if tensor.device != self._device or not tensor.is_contiguous():
            raise TransferError(f"group {self.spec.group_name}: a bucket must be contiguous on {self._device}, "
                                f"got {tensor.device}")
        with torch.cuda.device(self._device):
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            tensor.record_stream(self._stream)  # the allocator keeps its memory until the broadcast is done
            try:
                comm.bcast(tensor.data_ptr(), tensor.numel() * tensor.element_size(), self._nccl.NCCL_UINT8, 0,
                           self._stream.cuda_stream)
            except self._nccl.NcclError as exc:
                raise TransferError(f"rank {self.spec.rank} NCCL broadcast failed to start: {exc}") from exc
            done = torch.cuda.Event()
            done.record(self._stream)
        return _CupyPending(done, comm, self._nccl.NcclError, self.spec.rank)

    def _release(self) -> None:
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.abort()
