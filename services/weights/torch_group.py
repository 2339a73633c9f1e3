"""A weight-update group formed the way torch.distributed forms a named group, for members that join it
themselves: SGLang's scheduler (`init_weights_update_group`), like the trainers of verl and OpenRLHF.

Such a member connects to rank 0's store (`tcp://master_addr:master_port`), wraps it in
`PrefixStore(group_name)` and calls torch's `_new_process_group_helper`; every member of a group must build
its process group the same way, or their keys in the store never meet. So rank 0 (the trainer) does the same
over the store it hosts. The tensors then travel as one broadcast each (`send_tensors`), which is what
SGLang's `update_weights_from_distributed` posts on its side. torch's helper is private API: both sides must
run torch versions whose helper keys the store alike (the same torch on trainer and SGLang is safe).
"""

import datetime
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from services.weights.transfer import (
    GroupSpec,
    Pending,
    Transfer,
    TransferError,
    TransferTimeout,
    remaining,
    transfer_device,
)

_POLL_S = 0.0005


class _TorchPending(Pending):
    def __init__(self, work: dist.Work, rank: int, polled: bool):
        self.work = work
        self.rank = rank
        self.polled = polled

    def wait(self, deadline: float) -> None:
        try:
            if self.polled:  # NCCL's wait() only orders streams: completion is polled so the deadline holds
                while not self.work.is_completed():
                    if time.monotonic() > deadline:
                        raise TransferTimeout(f"rank {self.rank} broadcast: deadline passed")
                    time.sleep(_POLL_S)
                self.work.wait()
            else:
                self.work.wait(datetime.timedelta(seconds=remaining(deadline, f"rank {self.rank} broadcast")))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower():
                raise TransferTimeout(f"rank {self.rank} broadcast: {exc}") from exc
            raise TransferError(f"rank {self.rank} broadcast failed: {exc}") from exc


class TorchGroupTransfer(Transfer):
    """Rank `spec.rank` of a torch.distributed named group over `store` (rank 0 hosts it). gloo moves CPU
    tensors; nccl the tensors of `device`, a CUDA device of this process's own (NCCL connects at the first
    broadcast, as on SGLang's side)."""

    def __init__(self, spec: GroupSpec, store: dist.Store, timeout_s: float, device: torch.device):
        super().__init__(spec)
        if spec.backend not in ("gloo", "nccl"):
            raise TransferError(f"a torch.distributed group carries backend 'gloo' or 'nccl', not {spec.backend!r}")
        self._device = device
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            self.pg, _ = c10d._new_process_group_helper(
                spec.world_size, spec.rank, [], c10d.Backend(spec.backend), dist.PrefixStore(spec.group_name, store),
                group_name=spec.group_name, timeout=timeout)
        except (RuntimeError, ValueError, dist.DistStoreError) as exc:
            raise TransferError(f"group {spec.group_name}: {exc}") from exc
        # Group rank i is "global" rank i, as SGLang registers its side (torch.distributed.broadcast's src).
        c10d._world.pg_group_ranks[self.pg] = {i: i for i in range(spec.world_size)}

    @property
    def device(self) -> torch.device:
        return self._device

    def broadcast(self, tensor: torch.Tensor) -> Pending:
        if self.pg is None:
            raise TransferError(f"group {self.spec.group_name} was released")
        try:
            work = dist.broadcast(tensor, src=0, group=self.pg, async_op=True)
        except (RuntimeError, ValueError) as exc:
            raise TransferError(f"rank {self.spec.rank} broadcast failed to start: {exc}") from exc
        return _TorchPending(work, self.spec.rank, polled=self.spec.backend == "nccl")

    def _release(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            dist.destroy_process_group(pg)


def make_torch_group(spec: GroupSpec, timeout_s: float, store: dist.Store,
                     device: torch.device | str | None = None) -> TorchGroupTransfer:
    """Rank 0's side of a group whose other members join it as torch.distributed does (see the module docstring),
    over the store rank 0 hosts; `device` as for make_group."""
    return TorchGroupTransfer(spec, store, timeout_s, transfer_device(spec.backend, device))
