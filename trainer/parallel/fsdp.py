"""FSDP2 over the "dp" mesh, and its mixed precision.

Each decoder layer is one FSDP unit (its parameters all-gathered just before it runs and freed
after), and so is each block of a vision-language model's vision tower; the root holds the rest (embeddings, final
norm, LM head, value head, the tower's patch embedding and merger). Under mixed
precision the sharded parameters (what the optimizer steps: the master weights) stay float32;
FSDP all-gathers them cast to bfloat16, the forward and backward compute in bfloat16, and the
gradients are reduce-scattered in float32 into float32 shards.

With expert parallelism each experts module (already split over "ep", trainer/parallel/ep.py) is an FSDP unit of its
own over "edp", the ranks holding the same experts, inside its layer's unit over "dp".
"""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.model import PolicyModel
from trainer.parallel.ep import expert_modules


def mixed_precision_policy(dtype: str, device: torch.device, enabled: bool) -> MixedPrecisionPolicy:
    """bf16 parameters and compute, fp32 gradient reduction, when the trainer computes in bfloat16 on an
    accelerator; otherwise none (float32 throughout: CPU, and the exactness tests)."""
    if enabled and dtype == "bfloat16" and device.type != "cpu":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def uses_fsdp(env) -> bool:
    """Whether the policy is sharded by FSDP2 (and so cast by its mixed precision): under torchrun, except pipeline
    stages with one data-parallel rank (FSDP over one rank would only add unsharded copies of the parameters)."""
    return env.distributed and (env.pp_size == 1 or env.dp_size > 1)


def apply_fsdp(policy: PolicyModel, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy,
               experts_mesh: DeviceMesh | None = None) -> None:
    """Shard `policy` over `mesh` (the "dp" dimension) in place: each decoder layer (and vision block), then the root; with
    `experts_mesh` ("edp": expert parallelism), each layer's experts over it first."""
    for layer in policy.decoder_layers:
        for experts in expert_modules(layer) if experts_mesh is not None else ():
            fully_shard(experts, mesh=experts_mesh, mp_policy=mp_policy)
            # Their gradients sum over the whole expert group already: divided by dp, not by the edp ranks summed.
            experts.set_gradient_divide_factor(float(mesh.size()))
            # A custom factor reduces by PREMUL_SUM, which gloo lacks: a plain sum, then the division. Not over one
            # rank: FSDP (torch 2.13) then divides by the factor twice (its no-collective branch, and after).
            experts.set_force_sum_reduction_for_comms(experts_mesh.size() > 1)
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    for block in policy.vision_blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(policy, mesh=mesh, mp_policy=mp_policy)
