"""Weight transfer over gloo (CPU tensors, TCP): the default, and what tests use."""

import datetime
import os

import torch
import torch.distributed as dist

from services.net import is_loopback, source_address_towards
from services.weights.transfer import GroupSpec, Pending, Transfer, TransferError, TransferTimeout, remaining


def device_for(master_addr: str, rank: int) -> dist.ProcessGroupGloo.Device:
    """The interface this member's gloo endpoint binds, and so the address the others connect to.

    Rank 0 (the trainer) binds the configured interface, master_addr itself. With a loopback master every member
    is on this host: loopback. A receiver on another host binds the interface that routes to the trainer (or
    GLOO_SOCKET_IFNAME when set): gloo's own default, the hostname's address, is often 127.0.0.1, which two
    receivers on two hosts would each take for their own and never connect (the group is a full mesh).
    """
    if rank == 0 or is_loopback(master_addr):
        return dist.ProcessGroupGloo.create_device(hostname=master_addr)
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=source_address_towards(master_addr))


class _GlooPending(Pending):
    def __init__(self, work: dist.Work, rank: int):
        self.work = work
        self.rank = rank

    def wait(self, deadline: float) -> None:
        left = remaining(deadline, f"rank {self.rank} broadcast")
        try:
            self.work.wait(datetime.timedelta(seconds=left))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                raise TransferTimeout(f"rank {self.rank} broadcast: {exc}") from exc
            raise TransferError(f"rank {self.rank} broadcast failed: {exc}") from exc


class GlooTransfer(Transfer):
    """A ProcessGroupGloo on its own store prefix; every collective times out after `timeout_s`."""

    def __init__(self, spec: GroupSpec, store: dist.Store, timeout_s: float):
        super().__init__(spec)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._devices = [device_for(spec.master_addr, spec.rank)]
        try:
            self.pg: dist.ProcessGroupGloo | None = dist.ProcessGroupGloo(
                store, spec.rank, spec.world_size, options
            )
        except (RuntimeError, dist.DistStoreError) as exc:
            raise TransferTimeout(f"group {spec.group_name}: rendezvous of {spec.world_size} failed: {exc}") from exc

    def broadcast(self, tensor: torch.Tensor) -> Pending:
        if self.pg is None:
            raise TransferError(f"group {self.spec.group_name} was released")
        try:
            return _GlooPending(self.pg.broadcast(tensor, 0), self.spec.rank)
        except RuntimeError as exc:
            raise TransferError(f"rank {self.spec.rank} broadcast failed to start: {exc}") from exc

    def _release(self) -> None:
        self.pg = None
