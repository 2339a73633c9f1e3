"""Weight transfer over NCCL (CUDA tensors) through torch.distributed's ProcessGroupNCCL.

Each member must own a different GPU (NCCL refuses two ranks on one device) and call
`torch.cuda.set_device` before joining. Written against the same interface as gloo.py; it has not run
yet on this project's machines (no GPU), so treat it as untested.
"""

import datetime
import time

import torch
import torch.distributed as dist

from services.weights.transfer import GroupSpec, Pending, Transfer, TransferError, TransferTimeout


class _NcclPending(Pending):
    def __init__(self, work: dist.Work, rank: int):
        self.work = work
        self.rank = rank

    def wait(self, deadline: float) -> None:
        # NCCL's wait() only orders streams; completion is polled so the deadline holds on the host.
        while not self.work.is_completed():
            if time.monotonic() > deadline:
                raise TransferTimeout(f"rank {self.rank} NCCL broadcast: deadline passed")
            time.sleep(0.0005)
        if not self.work.is_success():
            raise TransferError(f"rank {self.rank} NCCL broadcast failed: {self.work.exception()}")


class NcclTransfer(Transfer):
    """A ProcessGroupNCCL on the current CUDA device; each member must use a different GPU."""

    def __init__(self, spec: GroupSpec, store: dist.Store, timeout_s: float):
        super().__init__(spec)
        if not torch.cuda.is_available():
            raise TransferError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        self._device = torch.device("cuda", torch.cuda.current_device())
        self.pg: dist.ProcessGroupNCCL | None = dist.ProcessGroupNCCL(store, spec.rank, spec.world_size, options)

    @property
    def device(self) -> torch.device:
        return self._device

    def broadcast(self, tensor: torch.Tensor) -> Pending:
        assert self.pg is not None, "broadcast on a released group"
        return _NcclPending(self.pg.broadcast(tensor, 0), self.spec.rank)

    def _release(self) -> None:
        if self.pg is not None:
            self.pg.abort()
        self.pg = None
