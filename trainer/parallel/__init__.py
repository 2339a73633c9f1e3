"""Parallelism: one (pp, dp, tp) device mesh, the policy split over it in one place, loaded and saved in shards.

mesh.py      the process group and the mesh; DistEnv, this rank's place in it
stages.py    pipeline stages over "pp": the layers split at layer boundaries, global parameter names kept
pipeline.py  a step's micro-batches through the stages (torch.distributed.pipelining schedules), bubble metrics
tp.py        tensor + sequence parallelism of the Hugging Face decoders over "tp"
ep.py        expert parallelism: a MoE policy's experts split over "ep" (lent by "dp"), tokens by all-to-all
fsdp.py      FSDP2 and its mixed precision over "dp"
compose.py   parallelize(): stages, then TP or EP, then activation checkpointing, then FSDP
loading.py   meta-device init and sharded loading from safetensors
state.py     state dicts whole (gathered to rank 0) or sharded (DCP)
"""

from trainer.parallel.compose import parallelize
from trainer.parallel.loading import build_policy
from trainer.parallel.mesh import DistEnv, init_distributed, shutdown_distributed
from trainer.parallel.state import (
    gather_model_state,
    gather_optimizer_state,
    load_model_state,
    load_optimizer_state,
    load_sharded_state,
    sharded_state,
    stage_model_state,
)

__all__ = [
    "DistEnv",
    "build_policy",
    "gather_model_state",
    "gather_optimizer_state",
    "init_distributed",
    "load_model_state",
    "load_optimizer_state",
    "load_sharded_state",
    "parallelize",
    "sharded_state",
    "shutdown_distributed",
    "stage_model_state",
]
