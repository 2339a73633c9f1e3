"""The `optim:` and `batch:` sections of the trainer config: what one optimizer step takes and how it steps."""

from typing import Literal

from pydantic import Field

from services.config import Strict


class OptimConfig(Strict):
    """AdamW with a linear warm-up."""

    lr: float = Field(1e-5, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warm-up from 0 to lr.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this; None = no clip.")


class BatchConfig(Strict):
    """How many samples make one optimizer step, and how they are split."""

    global_batch_size: int = Field(64, gt=0, description="Samples per pulled batch across all ranks (whole groups).")
    micro_batch_size: int = Field(8, gt=0, description="Samples per forward/backward on one rank (gradient accumulation); "
                                  "with max_tokens_per_micro_batch, the most samples one may hold.")
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, description="Token budget of one forward/backward on one rank, counted padded (samples x the "
        "longest), or with `packing` as the sum of the samples' lengths: the samples are sorted by length and packed "
        "into as few micro-batches as fit, so a batch of short and long episodes is not padded to its longest (verl's "
        "use_dynamic_bsz / ppo_max_token_len_per_gpu). A sample longer than the budget goes alone. Every algorithm; "
        "a DPO pair stays in one micro-batch. Every rank runs as many micro-batches as the rank that needs most. "
        "None = micro_batch_size samples each, in batch order.")
    packing: bool = Field(
        False, description="Run each micro-batch's samples packed end to end in rows (trainer/packing.py): position "
        "ids restart per sample, attention stays within each sample, no padding columns; the losses are the padded "
        "path's. Worth it where lengths vary (64 samples of 8-508 tokens: 1.6x faster on CPU); off by default, as "
        "the quickstart's samples are short and alike (there padding costs less than the packing: 1.08x slower).")
    pack_row_tokens: int | None = Field(
        None, gt=0, description="With packing, the tokens one packed row holds (a longer sample gets a row alone); "
        "None = one row per micro-batch (the best with varlen attention; a block mask costs row length squared).")
    packed_attention: Literal["varlen", "mask"] = Field(
        "varlen", description="With packing, how attention stays within each sample: varlen = by the samples' "
        "cumulative lengths (trainer/varlen.py): torch's flash varlen kernel on CUDA in bf16, one causal attention "
        "per sample elsewhere; mask = transformers' block-diagonal causal mask over each row (cost row length "
        "squared: use it with pack_row_tokens).")
    mini_batches: int = Field(
        1, gt=0, description="Optimizer steps per pulled batch (PPO mini-batches); the batch is split in this many."
    )

    def rows_per_rank(self, world_size: int) -> int:
        """Samples of one mini-batch on one rank."""
        return self.global_batch_size // self.mini_batches // world_size

    def check_divisible(self, world_size: int) -> None:
        """Raise ValueError naming the field unless the batch splits evenly over steps, ranks and micro-batches."""
        per_step = self.global_batch_size // self.mini_batches
        if self.global_batch_size % self.mini_batches:
            raise ValueError(f"batch.global_batch_size={self.global_batch_size} is not divisible by mini_batches={self.mini_batches}")
        if per_step % world_size:
            raise ValueError(f"batch.global_batch_size: {per_step} samples per step do not split over {world_size} ranks")
        if self.max_tokens_per_micro_batch is None and self.rows_per_rank(world_size) % self.micro_batch_size:
            raise ValueError(
                f"batch.micro_batch_size={self.micro_batch_size} does not divide the {self.rows_per_rank(world_size)} "
                "samples per rank and step"
            )
