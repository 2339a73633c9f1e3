"""The trainer's typed configuration: one pydantic model, every field documented, checked in one place.

TrainerConfig is the whole of a run's config (`python -m trainer --config FILE`); each of its sections is a
model of its own, in a module named after it: model, algorithm, optim (and batch), checkpoint, buffer, publish,
mismatch, parallel, moe.
"""

from typing import Literal

from pydantic import Field, model_validator

from services.config import Strict, TracingConfig
from trainer.config.algorithm import AlgorithmConfig
from trainer.config.buffer import BufferClientConfig
from trainer.config.checkpoint import CheckpointConfig
from trainer.config.mismatch import MismatchConfig
from trainer.config.model import ModelConfig
from trainer.config.moe import MoeConfig
from trainer.config.optim import BatchConfig, OptimConfig
from trainer.config.parallel import ParallelConfig
from trainer.config.profile import ProfileConfig
from trainer.config.publish import PublishConfig


class TrainerConfig(Strict):
    """Everything one training run needs."""

    model_path: str = Field(description="Hugging Face folder of the policy to train.")
    ref_model_path: str | None = Field(
        None,
        description="Frozen reference (KL, DPO) or teacher (distill) model, used when samples carry no ref_logprobs.",
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    buffer: BufferClientConfig = Field(default_factory=BufferClientConfig)
    max_steps: int | None = Field(100, gt=0, description="Stop after this many optimizer steps; None = until "
                                  "stopped (SIGTERM: the step under way ends, then the last checkpoint and export).")
    max_staleness: int | None = Field(
        None, ge=0, description="Fail loudly if a batch holds a sample older than this (the buffer enforces it)."
    )
    publish: PublishConfig = Field(default_factory=PublishConfig)
    mismatch: MismatchConfig = Field(default_factory=MismatchConfig, description="A bound on the rollout-vs-trainer "
                                     "logprob mismatch reported every step (mismatch/* in the metrics).")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    moe: MoeConfig = Field(default_factory=MoeConfig, description="A mixture-of-experts policy's routing replay "
                           "(R3) and load-balancing loss (moe/* in the metrics).")
    seed: int = Field(0, description="Seed for torch (value-head init, dropout).")
    deterministic: bool = Field(False, description="A deterministic run (deploy/experiment/schema.py): deterministic torch "
                                "kernels on num_threads threads (services/determinism.py), and each batch trained in "
                                "a canonical order of its samples (by group id, then sample id), whatever order the "
                                "buffer handed them out in.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype: bfloat16 on an accelerator = FSDP2 mixed precision under torchrun "
        "(parallel.mixed_precision), else autocast; the optimizer's parameters stay float32."
    )
    device: Literal["auto", "cpu", "cuda", "xpu", "npu"] = Field(
        "auto", description="Where the trainer computes (services/device.py): auto = the machine's accelerator "
        "(CUDA, XPU, or Ascend NPU with torch_npu installed) when there is one, else the CPU.")
    num_threads: int | None = Field(1, gt=0, description="torch threads per process (1 when processes share cores).")
    dist_timeout_s: float = Field(1800.0, gt=0, description="Timeout of torch.distributed collectives.")
    log_interval: int = Field(1, gt=0, description="Log metrics every this many steps.")
    metrics_path: str | None = Field(None, description="Append each step's metrics here as JSON lines (rank 0).")
    metrics_sample_ids: bool = Field(
        False, description="Also record each step's lease and sample ids in the metrics file (audits resumes)."
    )
    metrics_port: int | None = Field(None, ge=0, description="Serve Prometheus /metrics on 127.0.0.1:PORT from rank 0 "
                                     "(0 = any free port): step, weight version, logprob mismatch. None = off.")
    heartbeat_path: str | None = Field(
        None, description="Touch this file every heartbeat_interval_s from a daemon thread of rank 0 (from start-up "
        "on): a supervisor that finds it untouched knows the process is frozen, not merely busy. None = off."
    )
    heartbeat_interval_s: float = Field(2.0, gt=0, description="Seconds between touches of heartbeat_path.")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Where rank 0's spans go: each train "
                                   "step's, linking the traced samples it consumed (services/tracing.py).")
    profile: ProfileConfig = Field(default_factory=ProfileConfig, description="torch.profiler captures of chosen "
                                   "steps (trainer/profiling.py); off by default.")

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        if self.publish.backend not in ("gloo", "auto") and self.publish.receivers and self.device == "cpu":
            raise ValueError(f"publish.backend {self.publish.backend!r} sends from the trainer's GPU: set device to "
                             "cuda (or auto on a GPU machine), or use backend 'gloo'")
        if self.algorithm.name == "dpo" and self.batch.micro_batch_size % 2:
            raise ValueError("batch.micro_batch_size: DPO trains (chosen, rejected) pairs, so it must be even")
        if self.batch.packing and self.parallel.tp > 1:
            raise ValueError("batch.packing: not with parallel.tp > 1 yet (sequence parallelism pads every row to a "
                             "multiple of tp, and the packed rows' segments would have to cover that padding)")
        if self.parallel.pp > 1 and self.batch.packing:
            raise ValueError("parallel.pp > 1: not with batch.packing yet (a pipeline's micro-batches are padded to "
                             "one shape, not packed)")
        return self
