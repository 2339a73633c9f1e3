"""The policy's and optimizer's state across ranks: whole (gathered to rank 0: publish, export, the old
checkpoint format) or sharded (each rank its own DTensor shards: torch.distributed.checkpoint)."""

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
from torch.distributed.fsdp import FSDPModule

from trainer.parallel.mesh import DistEnv

_GATHER = StateDictOptions(full_state_dict=True, cpu_offload=True)
_SCATTER = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def _reshard(model: nn.Module) -> None:
    # After forward-only passes FSDP2 may hold unsharded parameters; loading a state dict
    # into that state fails with "mixed torch.Tensor and DTensor".
    for module in (model, *getattr(model, "pipeline_stages", ())):  # pipeline stages: FSDP roots of their own
        if isinstance(module, FSDPModule):
            module.reshard()


def gather_model_state(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU state dict on rank 0, {} on other ranks. Collective: every rank calls it."""
    if not env.distributed:
        return {name: tensor.detach().cpu().clone() for name, tensor in model.state_dict().items()}
    if env.pp_size > 1:
        return _gather_stages(model, env)
    return get_model_state_dict(model, options=_GATHER)


def stage_model_state(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """Pipeline stages: this stage's whole tensors (gathered over its "dp" shards), as CPU copies, on the stage's
    first rank (dp 0, tp 0); {} on its other ranks. Collective within the stage."""
    _reshard(model)
    own = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if env.dp_rank != 0 or env.mesh["tp"].get_local_rank() != 0:
        return {}
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in own.items()}


def _gather_stages(model: nn.Module, env: DistEnv) -> dict[str, torch.Tensor]:
    """Pipeline stages: each stage's whole tensors, then every stage's to rank 0 by the first data-parallel,
    tensor-parallel rank of each stage (rank 0's pp group)."""
    own = stage_model_state(model, env)
    if env.dp_rank != 0 or env.mesh["tp"].get_local_rank() != 0:
        return {}
    parts: list[Any] = [None] * env.pp_size if env.is_main else None
    dist.gather_object(own, parts, group=env.mesh["pp"].get_group(), group_dst=0)
    return {name: tensor for part in parts for name, tensor in part.items()} if env.is_main else {}


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


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    """{"model": ..., "optimizer": ...}: this rank's shards (DTensors under torchrun, whole tensors in a world of
    one), keyed by parameter name; the live tensors, not copies. Collective (the optimizer's state is made on
    every rank if no step has run yet)."""
    _reshard(model)
    return {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}


def load_sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, dict[str, Any]]) -> None:
    """Put a `sharded_state`-shaped dict (filled by torch.distributed.checkpoint) into model and optimizer."""
    _reshard(model)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optimizer"])
