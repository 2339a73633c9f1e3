"""Forms a weight-update group: gloo.py, nccl.py, cupy_nccl.py, or cuda_ipc.py when every receiver shares the
trainer's GPU.

Above the backends: each imports only the interface (transfer.py), and this module picks one. Every member first
checks in on the group's store with the device it stages on (nccl_rendezvous.check_in); from those identities
and rank 0's word on whether it may share its memory, every member picks the same backend (cuda_ipc.choose_backend).
"""

import torch
import torch.distributed as dist

from services.weights.cuda_ipc import IPC, CudaIpcTransfer, choose_backend, ipc_possible
from services.weights.cupy_nccl import CupyNcclTransfer
from services.weights.gloo import GlooTransfer
from services.weights.nccl import NcclTransfer
from services.weights.nccl_rendezvous import check_in, device_identity, refuse_shared_gpus
from services.weights.transfer import GroupSpec, Transfer, deadline_after, join_store, transfer_device

_IPC_ALLOWED = "cuda-ipc-allowed"


def make_group(spec: GroupSpec, timeout_s: float, store: dist.Store | None = None,
               device: torch.device | str | None = None, cuda_ipc: bool = True) -> Transfer:
    """Form the group described by `spec` (blocks until every member joined, at most `timeout_s`).

    Rank 0 passes the store it hosts (`host_store`); the others connect to it. Each group lives under
    its own `group_name` prefix, so one store serves every group the trainer forms. `device`: where this member's
    tensors are (the trainer's, the rollout engine's), with its CUDA index for the NCCL backends (see
    transfer_device). When every receiver's device is on the GPU of rank 0's, the group carries CUDA IPC handles
    (cuda_ipc.py) whatever `spec.backend` says, unless rank 0 passes `cuda_ipc=False`.
    """
    deadline = deadline_after(timeout_s)
    store = store if store is not None else join_store(spec, timeout_s)
    scoped = dist.PrefixStore(f"{spec.group_name}/", store)
    checking_in = dist.PrefixStore("check-in/", scoped)
    member = None if device is None else torch.device(device)
    if spec.rank == 0:  # before its check-in: every member reads it once all have checked in
        checking_in.set(_IPC_ALLOWED, "1" if cuda_ipc and ipc_possible(member) else "0")
    identities = check_in(checking_in, spec.group_name, spec.rank, spec.world_size, device_identity(member), deadline,
                          one_gpu_each=False)
    backend = choose_backend(spec.backend, identities, checking_in.get(_IPC_ALLOWED) == b"1")
    if backend == IPC:
        return CudaIpcTransfer(spec, scoped, transfer_device(IPC, member))
    if backend == "gloo":
        return GlooTransfer(spec, scoped, timeout_s)
    refuse_shared_gpus(spec.group_name, spec.rank, identities)
    on = transfer_device(backend, device)
    if backend == "cupy_nccl":
        return CupyNcclTransfer(spec, scoped, timeout_s, on)
    return NcclTransfer(spec, scoped, timeout_s, on)
