"""FSDP2 over the "dp" mesh, and its mixed precision.

Each decoder layer is one FSDP unit (its parameters all-gathered just before it runs and freed
after), the root holds the rest (embeddings, final norm, LM head, value head). Under mixed
precision the sharded parameters (what the optimizer steps: the master weights) stay float32;
FSDP all-gathers them cast to bfloat16, the forward and backward compute in bfloat16, and the
gradients are reduce-scattered in float32 into float32 shards.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.model import PolicyModel


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


def apply_fsdp(policy: PolicyModel, mesh: DeviceMesh, mp_policy: MixedPrecisionPolicy) -> None:
    """Shard `policy` over `mesh` (the "dp" dimension) in place: each decoder layer, then the root."""
    for layer in policy.decoder_layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(policy, mesh=mesh, mp_policy=mp_policy)
