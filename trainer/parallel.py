"""Data parallelism: torch.distributed set-up, FSDP2 sharding, and full state dicts on rank 0.

Under `torchrun` (WORLD_SIZE in the environment) the trainer joins a process group (gloo on
CPU, nccl on GPU) over one named device mesh ("dp") and shards the policy with FSDP2; run as a
plain process it is a world of one with an unsharded model and the same code path otherwise.
"""

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from services.device import collective_backend, resolve_device, set_current
from trainer.model import PolicyModel, checkpoint_layers

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


@dataclass
class DistEnv:
    """This process's place in the data-parallel world."""

    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.mesh is not None

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum of `tensor` over ranks (in place; returned for convenience)."""
        if self.distributed:
            on_device = tensor.to(self.device)
            dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
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


def init_distributed(device: str = "auto", timeout_s: float = 1800.0) -> DistEnv:
    """Join the torchrun process group if there is one; otherwise a world of one. `device` as services/device.py
    resolves it (auto = the machine's accelerator, else the CPU)."""
    if "WORLD_SIZE" not in os.environ:
        # With its index: the weight broadcast's NCCL group is made on exactly this device.
        return DistEnv(rank=0, world_size=1, device=resolve_device(device))
    torch_device = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    set_current(torch_device)
    if not dist.is_initialized():
        dist.init_process_group(collective_backend(torch_device), timeout=timedelta(seconds=timeout_s))
    world_size = dist.get_world_size()
    mesh = init_device_mesh(torch_device.type, (world_size,), mesh_dim_names=("dp",))
    return DistEnv(rank=dist.get_rank(), world_size=world_size, device=torch_device, mesh=mesh)


def shutdown_distributed(env: DistEnv) -> None:
    """Leave the group together: a barrier first, so no rank tears its gloo connections down while a peer's
    last collective still uses them (that aborted a rank at exit: "terminate called without an active exception")."""
    if env.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def parallelize(model: PolicyModel, env: DistEnv, activation_checkpointing: bool = False) -> PolicyModel:
    """The model's wrappers, in order: activation checkpointing per decoder layer (if asked), then FSDP2: each
    decoder layer, then the root (embeddings, final norm, head, value head)."""
    if activation_checkpointing:
        checkpoint_layers(model)
    if not env.distributed:
        return model
    for layer in model.decoder_layers:
        fully_shard(layer, mesh=env.mesh)
    fully_shard(model, mesh=env.mesh)
    return model


def _reshard(model: nn.Module) -> None:
    # After forward-only passes FSDP2 may hold unsharded parameters; loading a state dict
    # into that state fails with "mixed torch.Tensor and DTensor".
    if isinstance(model, FSDPModule):
        model.reshard()


def gather_model_state(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict on rank 0, {} on other ranks. Collective: every rank calls it."""
    if not env.distributed:
        return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    return get_model_state_dict(model, options=_GATHER)


def gather_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv) -> dict[str, Any]:
    """Full optimizer state keyed by parameter names on rank 0 ({} elsewhere). Collective."""
    if not env.distributed:
        return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))
    return get_optimizer_state_dict(model, optimizer, options=_GATHER)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], env: DistEnv) -> None:
    """Load a full state dict held by rank 0 into every rank's shards. Collective."""
    if not env.distributed:
        model.load_state_dict(state)
        return
    _reshard(model)
    set_model_state_dict(model, state, options=_SCATTER)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], env: DistEnv) -> None:
    """Load a full optimizer state dict held by rank 0 into every rank. Collective."""
    if not env.distributed:
        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
        return
    _reshard(model)
    set_optimizer_state_dict(model, optimizer, state, options=_SCATTER)
