"""Weight transfer over NCCL (CUDA tensors) through torch.distributed's ProcessGroupNCCL.

Each member names its CUDA device (transfer.transfer_device) and must own a different GPU; the members have
checked in on the store first (backends.make_group, nccl_rendezvous.py) and the communicator is created eagerly on
that device, so neither a missing member nor a shared GPU can block past the rendezvous deadline or surface at
the first broadcast.
Runs only where CUDA is: tests/test_weight_sync_nccl.py (marker `gpu`).
"""

import datetime
import threading
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
)

_POLL_S = 0.0005


class _NcclPending(Pending):
    def __init__(self, work: dist.Work, rank: int):
        self.work = work
        self.rank = rank

    def wait(self, deadline: float) -> None:
        # NCCL's wait() only orders streams; completion is polled so the deadline holds on the host.
        while not self.work.is_completed():
            if time.monotonic() > deadline:
                raise TransferTimeout(f"rank {self.rank} NCCL broadcast: deadline passed")
            time.sleep(_POLL_S)
        try:  # completed, or failed: wait() raises the work's error (is_success() is not supported by NCCL work)
            self.work.wait()
        except RuntimeError as exc:
            raise TransferError(f"rank {self.rank} NCCL broadcast failed: {exc}") from exc


class NcclTransfer(Transfer):
    """A ProcessGroupNCCL whose communicator lives on `device`; every wait ends at its deadline."""

    def __init__(self, spec: GroupSpec, store: dist.Store, timeout_s: float, device: torch.device):
        super().__init__(spec)
        if not dist.is_nccl_available() or not torch.cuda.is_available():
            raise TransferError("backend 'nccl' needs torch with CUDA and NCCL; on CPU use backend 'gloo'")
        self._device = device
        deadline = deadline_after(timeout_s)
        options = dist.ProcessGroupNCCL.Options()
        # torch's watchdog ends the whole process when a collective outlives this timeout (its default error
        # handling): twice ours, so that our own deadline fires first and only the group is aborted.
        options._timeout = datetime.timedelta(seconds=2 * timeout_s)
        # As torch.distributed builds one for a bound device: the communicator is made now, not at the first use.
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("torch-nccl/", store), spec.rank, spec.world_size, options)
        pg._set_sequence_number_for_group()
        try:
            within(deadline, f"group {spec.group_name}: NCCL communicator on {device}",
                   lambda: pg.eager_connect_single_device(device))
        except TransferError:
            threading.Thread(target=pg.abort, name=f"abort-{spec.group_name}", daemon=True).start()
            raise
        self.pg: dist.ProcessGroupNCCL | None = pg

    @property
    def device(self) -> torch.device:
        return self._device

    def broadcast(self, tensor: torch.Tensor) -> Pending:
        if self.pg is None:
            raise TransferError(f"group {self.spec.group_name} was released")
        if tensor.device != self._device:
            raise TransferError(f"group {self.spec.group_name}: a bucket on {tensor.device}, the group is on {self._device}")
        try:
            return _NcclPending(self.pg.broadcast(tensor, 0), self.spec.rank)
        except RuntimeError as exc:
            raise TransferError(f"rank {self.spec.rank} NCCL broadcast failed to start: {exc}") from exc

    def _release(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.abort()
