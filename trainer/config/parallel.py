"""The `parallel:` section of the trainer config: how the policy is split over the trainer's processes."""

from pydantic import Field

from services.config import Strict


class ParallelConfig(Strict):
    """Parallelism over the torchrun processes: a (dp, tp) device mesh (trainer/parallel/)."""

    tp: int = Field(
        1, ge=1, description="Tensor-parallel degree: each decoder layer's heads and MLP columns are split over this "
        "many neighbouring ranks, with the residual stream split by sequence (sequence parallel); the world is "
        "world / tp data-parallel groups, FSDP2 shards over those. It must divide the processes, the attention and "
        "K/V heads and the MLP width.",
    )
    mixed_precision: bool = Field(
        True, description="With dtype bfloat16 on an accelerator under torch.distributed: FSDP2 all-gathers "
        "parameters in bfloat16 and computes in it, reduces gradients in float32, and the optimizer steps the "
        "float32 shards (master weights). False: float32 parameters with bfloat16 autocast. A CPU trainer computes "
        "in float32 either way.",
    )
