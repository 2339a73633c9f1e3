"""The `parallel:` section of the trainer config: how the policy is split over the trainer's processes."""

from typing import Literal

from pydantic import Field, model_validator

from services.config import Strict


class ParallelConfig(Strict):
    """Parallelism over the torchrun processes: a (pp, dp, tp) device mesh (trainer/parallel/)."""

    tp: int = Field(
        1, ge=1, description="Tensor-parallel degree: each decoder layer's heads and MLP columns are split over this "
        "many neighbouring ranks, with the residual stream split by sequence (sequence parallel); the world is "
        "world / tp data-parallel groups, FSDP2 shards over those. It must divide the processes, the attention and "
        "K/V heads and the MLP width.",
    )
    ep: int = Field(
        1, ge=1, description="Expert-parallel degree of a mixture-of-experts policy: each MoE layer's experts are "
        "split over this many neighbouring data-parallel ranks (no extra mesh dimension: \"dp\" is lent as (dp / ep, "
        "ep)), tokens sent to their experts' ranks and back by all-to-all (trainer/parallel/ep.py); the expert "
        "weights are FSDP-sharded over the dp / ep ranks that hold the same experts, everything else over all of "
        "dp. It must divide the data-parallel ranks and the model's num_experts; not with tp > 1 or pp > 1 yet.",
    )
    mixed_precision: bool = Field(
        True, description="With dtype bfloat16 on an accelerator under torch.distributed: FSDP2 all-gathers "
        "parameters in bfloat16 and computes in it, reduces gradients in float32, and the optimizer steps the "
        "float32 shards (master weights). False: float32 parameters with bfloat16 autocast. A CPU trainer computes "
        "in float32 either way.",
    )
    pp: int = Field(
        1, ge=1, description="Pipeline-parallel degree: the decoder's layers are split at layer boundaries into this "
        "many stages (trainer/parallel/stages.py; the embedding with the first, the final norm, the LM head and the "
        "value head with the last), one group of ranks each, outermost on the mesh (pp, dp, tp). Each optimizer "
        "step's micro-batches run through the stages by `pp_schedule`; parameter names stay the whole model's, so "
        "checkpoints resume on any pp. With tp > 1 each stage's layers are split by TP. It must divide the "
        "processes; not with tied embeddings or packing yet.",
    )
    pp_schedule: Literal["1f1b", "interleaved_1f1b", "interleaved_zero_bubble"] = Field(
        "1f1b", description="With pp > 1, torch.distributed.pipelining's schedule: 1f1b (Schedule1F1B: one stage "
        "per rank, at least pp micro-batches a step), interleaved_1f1b (ScheduleInterleaved1F1B: "
        "`pp_virtual_stages` stages per rank, a smaller bubble), interleaved_zero_bubble "
        "(ScheduleInterleavedZeroBubble: the weight gradients fill the bubble).",
    )
    pp_virtual_stages: int = Field(
        2, ge=1, description="With an interleaved schedule, the stages each rank holds (rank r: stages r, r + pp, "
        "...); 1f1b holds one.",
    )
    pp_split: list[int] | None = Field(
        None, description="With pp > 1, the decoder layers of each stage in order (pp entries, pp * "
        "pp_virtual_stages with an interleaved schedule), summing to the model's layers; None = balanced by layer "
        "count (the first stages take one more when it does not divide).",
    )

    @model_validator(mode="after")
    def _check_pp(self) -> "ParallelConfig":
        if self.ep > 1 and (self.tp > 1 or self.pp > 1):
            raise ValueError(f"parallel.ep={self.ep}: not with parallel.tp > 1 or parallel.pp > 1 yet (a mixture-of-"
                             "experts policy trains with data and expert parallelism only)")
        if self.pp_split is not None and (len(self.pp_split) != self.stages() or min(self.pp_split) < 1):
            raise ValueError(f"parallel.pp_split: {self.stages()} stages of at least one layer each, got "
                             f"{self.pp_split}")
        return self

    def stages(self) -> int:
        """How many pipeline stages the model is split into (pp, or pp * virtual stages when interleaved)."""
        return self.pp * (self.pp_virtual_stages if self.pp_schedule != "1f1b" else 1)
