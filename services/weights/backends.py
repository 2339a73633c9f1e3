"""Forms a weight-update group with the backend its spec names: gloo.py, nccl.py or cupy_nccl.py.

Above the backends: each imports only the interface (transfer.py), and this module picks one.
"""

import torch
import torch.distributed as dist

from services.weights.cupy_nccl import CupyNcclTransfer
from services.weights.gloo import GlooTransfer
from services.weights.nccl import NcclTransfer
from services.weights.transfer import GroupSpec, Transfer, join_store, transfer_device


def make_group(spec: GroupSpec, timeout_s: float, store: dist.Store | None = None,
               device: torch.device | str | None = None) -> Transfer:
    """Form the group described by `spec` (blocks until every member joined, at most `timeout_s`).

    Rank 0 passes the store it hosts (`host_store`); the others connect to it. Each group lives under
    its own `group_name` prefix, so one store serves every group the trainer forms. `device`: this member's
    CUDA device for the NCCL backends (see transfer_device); ignored by gloo.
    """
    on = transfer_device(spec.backend, device)
    store = store if store is not None else join_store(spec, timeout_s)
    scoped = dist.PrefixStore(f"{spec.group_name}/", store)
    if spec.backend == "gloo":
        return GlooTransfer(spec, scoped, timeout_s)
    if spec.backend == "cupy_nccl":
        return CupyNcclTransfer(spec, scoped, timeout_s, on)
    return NcclTransfer(spec, scoped, timeout_s, on)
