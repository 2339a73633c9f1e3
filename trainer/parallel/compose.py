"""The one place that splits the policy over the mesh, in a fixed order: pipeline stages, then TP or EP, then
activation checkpointing, then FSDP.

Stages first (parallel.pp > 1, trainer/parallel/stages.py): each rank keeps only its stages' layers, and what
follows applies per stage: TP to the layers, embedding, norm and heads the rank still holds, then checkpointing and
FSDP per stage (stages.shard_stages).

TP first: it replaces each split weight by a DTensor on the "tp" mesh; activation checkpointing wraps whole
decoder layers (so a recomputed layer redoes its TP collectives); FSDP last shards every parameter, TP-split
or not, over "dp" and all-gathers it around each layer. EP (parallel.ep > 1, a mixture-of-experts policy; never with
TP or stages) splits each MoE layer's experts over "ep", a split of "dp" (trainer/parallel/ep.py); FSDP then shards
those over the rest of "dp" ("edp") only. Models stay plain Hugging Face modules.
"""

from collections.abc import Callable

from trainer.config.parallel import ParallelConfig
from trainer.model import PolicyModel
from trainer.parallel.ep import apply_ep
from trainer.parallel.fsdp import apply_fsdp, mixed_precision_policy
from trainer.parallel.mesh import DistEnv
from trainer.parallel.stages import shard_stages, split_stages
from trainer.parallel.tp import apply_tp, pad_sequences


def parallelize(
    policy: PolicyModel,
    env: DistEnv,
    config: ParallelConfig | None = None,
    dtype: str = "float32",
    checkpoint_layers: Callable[[PolicyModel], None] | None = None,
) -> PolicyModel:
    """Split `policy` in place over env's (pp, dp, tp) mesh (and its experts over "ep"); a world of one keeps it
    whole (activation checkpointing still applies). Works on a model on the meta device (trainer/parallel/loading.py materialises and loads it
    afterwards)."""
    config = config or ParallelConfig()
    if env.pp_size > 1:
        split_stages(policy, env, config)
        if env.tp_size > 1:
            apply_tp(policy, env.mesh["tp"])
        shard_stages(policy, env, config, dtype, checkpointing=checkpoint_layers is not None)
        return policy
    if env.distributed and env.tp_size > 1:
        apply_tp(policy, env.mesh["tp"])
    if env.ep_size > 1:
        apply_ep(policy, env.expert_mesh["ep"])
    if checkpoint_layers is not None:
        checkpoint_layers(policy)
    if not env.distributed:
        return policy
    experts_mesh = env.expert_mesh["edp"] if env.ep_size > 1 else None
    apply_fsdp(policy, env.mesh["dp"], mixed_precision_policy(dtype, env.device, config.mixed_precision), experts_mesh)
    if env.tp_size > 1:
        pad_sequences(policy, env.tp_size)
    return policy
