"""The process group and the one device mesh every parallelism is laid over: ("pp", "dp", "tp").

Under `torchrun` (WORLD_SIZE in the environment) the trainer joins a process group (the device's
backend, services/device.py: gloo on CPU, nccl on GPU) and lays its ranks out as a 3-D mesh of `pp` pipeline
stages, each `world / (pp * tp)` data-parallel groups of `tp` tensor-parallel ranks (rank = (pp_rank * dp +
dp_rank) * tp + tp_rank: the ranks of one TP group are neighbours, on one node; pipeline stages are outermost,
their point-to-point activations the cheapest traffic to send between nodes). Expert parallelism (parallel.ep)
adds no dimension: it splits "dp" into ("edp", "ep") on a second view of the same ranks (`expert_mesh`, dp rank =
edp_rank * ep + ep_rank: an expert group is ep neighbouring data-parallel ranks; trainer/parallel/ep.py). Ranks of one TP group, and the stages of one pipeline, see the same rows; sums over the batch
(metrics, normalisers) run over "dp" only. Run as a plain process it is a world of one with no mesh and the same
code path otherwise.
"""

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from services.device import collective_backend, resolve_device, set_current

MESH_DIMS = ("pp", "dp", "tp")


@dataclass
class DistEnv:
    """This process's place in the world: global rank, the device, and the (pp, dp, tp) mesh (None: a world of
    one); with expert parallelism, the same ranks as (pp, edp, ep, tp)."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None = None
    expert_mesh: DeviceMesh | None = None

    @property
    def ep_size(self) -> int:
        """How many ranks of "dp" split each MoE layer's experts (1: every rank holds them all)."""
        return self.expert_mesh["ep"].size() if self.expert_mesh is not None else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    @property
    def tp_size(self) -> int:
        return self.mesh["tp"].size() if self.distributed else 1

    @property
    def pp_size(self) -> int:
        """How many pipeline stages the policy's layers are split into (trainer/parallel/pipeline.py)."""
        return self.mesh["pp"].size() if self.distributed else 1

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank() if self.distributed else 0

    @property
    def dp_size(self) -> int:
        """How many ways the batch is split (world / (pp * tp))."""
        return self.mesh["dp"].size() if self.distributed else 1

    @property
    def dp_rank(self) -> int:
        """Which share of the batch this rank trains on (the same for every rank of one TP group)."""
        return self.mesh["dp"].get_local_rank() if self.distributed else 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over the data-parallel ranks (in place; returned for convenience). The ranks of one
        TP group hold the same rows, so they count once."""
        if self.distributed:
            on_device = tensor.to(self.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.SUM, group=self.mesh["dp"].get_group())
            tensor.copy_(on_device)
        return tensor

    def all_reduce_max(self, value: int) -> int:
        """The largest of every rank's `value`."""
        if not self.distributed:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return int(tensor.item())

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled; for batches of samples and small metadata)."""
        if not self.distributed:
            return obj
        payload = [obj if self.is_main else None]
        dist.broadcast_object_list(payload, src=0, device=self.device if self.device.type != "cpu" else None)
        return payload[0]

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def init_distributed(device: str = "auto", timeout_s: float = 1800.0, tp: int = 1, pp: int = 1,
                     ep: int = 1) -> DistEnv:
    """Join the torchrun process group if there is one, as a (pp, world / (pp * tp), tp) mesh (and, with ep > 1,
    its "dp" split as (dp / ep, ep)); otherwise a world of one.
    `device` as services/device.py resolves it (auto = the machine's accelerator, else the CPU)."""
    if "WORLD_SIZE" not in os.environ:
        if tp != 1 or pp != 1 or ep != 1:
            raise ValueError(f"parallel.tp={tp}, parallel.pp={pp}, parallel.ep={ep} need several processes: start the "
                             "trainer under torchrun")
        # With its index: the weight broadcast's NCCL group is made on exactly this device.
        return DistEnv(rank=0, world_size=1, device=resolve_device(device))
    torch_device = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    set_current(torch_device)
    if not dist.is_initialized():
        dist.init_process_group(collective_backend(torch_device), timeout=timedelta(seconds=timeout_s))
    world_size = dist.get_world_size()
    if world_size % (tp * pp):
        raise ValueError(f"parallel.tp={tp} x parallel.pp={pp} does not divide the {world_size} processes")
    dp = world_size // (tp * pp)
    if dp % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the {dp} data-parallel ranks (processes / (tp * pp))")
    mesh = init_device_mesh(torch_device.type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
    expert_mesh = mesh._unflatten("dp", (dp // ep, ep), ("edp", "ep")) if ep > 1 else None
    return DistEnv(rank=dist.get_rank(), world_size=world_size, device=torch_device, mesh=mesh, expert_mesh=expert_mesh)


def shutdown_distributed(env: DistEnv) -> None:
    """Leave the group together: a barrier first, so no rank tears its gloo connections down while a peer's
    last collective still uses them (that aborted a rank at exit: "terminate called without an active exception")."""
    if env.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
