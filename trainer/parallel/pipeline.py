"""Running one step's micro-batches through the pipeline stages (torch.distributed.pipelining).

Each call builds the stages' `PipelineStage`s and the schedule afresh for that step's micro-batch shape: every
micro-batch is padded to the step's widest and longest (right-padded columns are masked; padding rows attend to
one pad token and weigh nothing), so the stages exchange activations of one shape. Under TP the width is padded
to a multiple of tp and each rank sends and receives its share of positions ([rows, width / tp, hidden]: the
residual stream is sequence-parallel, trainer/parallel/tp.py). Every rank holds the whole
batch; the stages get the micro-batch's input ids and attention mask as keyword arguments, and the last stage's
(logprobs, entropy, values) go to the caller's loss function, one micro-batch at a time: the losses are the
trainer's own, their weights already normalised over the whole mini-batch (trainer/learner.py computes them before
the schedule runs), so the schedule's own gradient scaling is off (`scale_grads=False`) and the gradients are
the sum of the micro-batches' as without stages.

Each stage times its forward and backward computations; a step's bubble on a rank is the fraction of the
schedule's wall time it computed nothing (waiting on a neighbour stage, or sending), reported with the peak memory
per stage (`step_metrics`).
"""

import resource
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)
from torch.distributed.tensor import DTensor

from trainer.batch import TrainBatch
from trainer.config.parallel import ParallelConfig
from trainer.model import PolicyOutput
from trainer.parallel.fsdp import mixed_precision_policy, uses_fsdp
from trainer.parallel.mesh import DistEnv

SCHEDULES = {"1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
             "interleaved_zero_bubble": ScheduleInterleavedZeroBubble}

LossFn = Callable[[int, PolicyOutput], torch.Tensor]


class TimedStage(PipelineStage):
    """A PipelineStage that adds up the seconds it spends computing (forward, backward, weight backward)."""

    busy_s = 0.0

    def _timed(self, method, *args, **kwargs):
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self.busy_s += time.perf_counter() - start

    def forward_one_chunk(self, *args, **kwargs):
        return self._timed(super().forward_one_chunk, *args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_one_chunk, *args, **kwargs)

    def backward_weight_one_chunk(self, *args, **kwargs):
        return self._timed(super().backward_weight_one_chunk, *args, **kwargs)


class Pipeline:
    """The stages of one policy on this rank (a policy pruned by trainer/parallel/stages.py) and how to run them."""

    def __init__(self, policy: nn.Module, env: DistEnv, config: ParallelConfig, pad_id: int,
                 dtype: str = "float32") -> None:
        self.policy, self.env, self.config, self.pad_id = policy, env, config, pad_id
        if config.pp_schedule == "interleaved_zero_bubble" and uses_fsdp(env):
            raise ValueError("parallel.pp_schedule interleaved_zero_bubble: not with FSDP (dp > 1) yet: its deferred "
                             "weight gradients gave other steps than one process (tests/test_trainer_pipeline.py)")
        self.modules = policy.pipeline_stages
        self.stage_ids = policy.pipeline_stage_ids
        self.group = env.mesh["pp"].get_group()
        self.last_rank = (config.stages() - 1) % env.pp_size  # the pp rank holding the last stage
        self.holds_last = env.pp_rank == self.last_rank
        mp = mixed_precision_policy(dtype, env.device, config.mixed_precision)  # FSDP's casts set the stream's
        self.hidden_dtype = (mp.param_dtype if uses_fsdp(env) else None) or torch.float32
        self.last_schedule: Any = None
        self.timing = (0.0, 0.0)  # (busy seconds, wall seconds) of the last run

    def run(self, micro_batches: list[tuple[Any, TrainBatch]], temperatures: Callable[[TrainBatch], Any],
            loss_fn: LossFn | None = None, *, entropy: bool = True, entropy_grad: bool = False
            ) -> list[PolicyOutput] | None:
        """Forward (and with `loss_fn`, backward) every micro-batch (the learner's (rows, batch) pairs) through
        the stages, each row scored at `temperatures(batch)` ([R] or None = 1). `loss_fn(index, output)` is called
        on the last stage with micro-batch `index`'s outputs cut to its shape and returns the tensor to
        differentiate. Without `loss_fn`: the outputs, on the rank holding the last stage (None elsewhere)."""
        micros = [(micro.input_ids, micro.attention_mask, temperatures(micro)) for _, micro in micro_batches]
        rows = max(ids.shape[0] for ids, _, _ in micros)
        width = max(ids.shape[1] for ids, _, _ in micros)
        width += -width % self.env.tp_size  # sequence parallel: each TP rank holds width / tp positions
        input_ids, attention, inv = self._padded(micros, rows, width)
        shapes = [ids.shape for ids, _, _ in micros]
        values = self.policy.value_head is not None
        for module in self.modules:
            module.entropy = entropy
        stages = [self._stage(module, index, rows, width, entropy, values)
                  for module, index in zip(self.modules, self.stage_ids, strict=True)]

        def loss(output, target):
            index = int(target[0])
            return loss_fn(index, _cut(output, shapes[index], entropy, values, entropy_grad))

        schedule = self._schedule(stages, len(micros), loss if loss_fn is not None else None)
        kwargs = {"input_ids": input_ids, "attention_mask": attention}
        if inv is not None:
            kwargs["inv_temperatures"] = inv
        target = torch.arange(len(micros), device=self.env.device) if loss_fn is not None else None
        start = time.perf_counter()
        schedule.step(input_ids, target=target, return_outputs=loss_fn is None, **kwargs)
        self.timing = (sum(stage.busy_s for stage in stages), time.perf_counter() - start)
        self.last_schedule = schedule
        if loss_fn is not None or not self.holds_last:
            return None
        chunks = stages[-1].output_chunks
        return [_cut(output, shape, entropy, values, False) for output, shape in zip(chunks, shapes, strict=True)]

    def _padded(self, micros: list[tuple], rows: int, width: int):
        """The micro-batches stacked [n * rows, width]; padding rows attend to their first (pad) token only."""
        n, device = len(micros), self.env.device
        input_ids = torch.full((n, rows, width), self.pad_id, dtype=torch.int64, device=device)
        attention = torch.zeros((n, rows, width), dtype=micros[0][1].dtype, device=device)
        attention[:, :, 0] = 1
        tempered = any(t is not None and bool((t != 1.0).any()) for _, _, t in micros)
        inv = torch.ones((n, rows, width - 1), dtype=torch.float32, device=device) if tempered else None
        for m, (ids, mask, temperatures) in enumerate(micros):
            input_ids[m, : ids.shape[0], : ids.shape[1]] = ids
            attention[m, : ids.shape[0], : ids.shape[1]] = mask
            if inv is not None and temperatures is not None:
                inv[m, : ids.shape[0]] = 1.0 / temperatures.to(device, torch.float32)[:, None]
        flat = (input_ids.view(n * rows, width), attention.view(n * rows, width))
        return (*flat, inv.view(n * rows, width - 1) if inv is not None else None)

    def _stage(self, module: nn.Module, index: int, rows: int, width: int, entropy: bool, values: bool):
        hidden = torch.empty((rows, width // self.env.tp_size, self.policy.lm.config.hidden_size),
                             dtype=self.hidden_dtype, device="meta",
                             requires_grad=torch.is_grad_enabled())  # received with its gradient (TP: its share)
        inputs = torch.empty((rows, width), dtype=torch.int64, device="meta") if index == 0 else hidden
        if index < self.config.stages() - 1:
            outputs: Any = hidden
        else:
            token = torch.empty((rows, width - 1), dtype=torch.float32, device="meta")
            value = torch.empty((rows, width, 1), dtype=self.hidden_dtype, device="meta")  # TP: gathered, whole
            outputs = (token,) + ((token,) if entropy else ()) + ((value,) if values else ())
        return TimedStage(module, index, self.config.stages(), self.env.device, input_args=inputs,
                          output_args=outputs, group=self.group)

    def _schedule(self, stages: list[PipelineStage], micro_batches: int, loss):
        kind = SCHEDULES[self.config.pp_schedule]
        if micro_batches < self.env.pp_size:
            raise ValueError(f"parallel.pp={self.env.pp_size}: a step needs at least as many micro-batches, this "
                             f"one has {micro_batches} (lower batch.micro_batch_size)")
        if kind is Schedule1F1B:
            return kind(stages[0], micro_batches, loss_fn=loss, scale_grads=False)
        return kind(stages, micro_batches, loss_fn=loss, scale_grads=False)

    # -- across the stages -------------------------------------------------------------------

    def from_last(self, obj: Any) -> Any:
        """The last stage's `obj` on every stage of this pipeline (pickled)."""
        payload = [obj if self.holds_last else None]
        dist.broadcast_object_list(payload, group=self.group, group_src=self.last_rank,
                                   device=self.env.device if self.env.device.type != "cpu" else None)
        return payload[0]

    def share(self, *tensors: torch.Tensor | None) -> None:
        """The last stage's `tensors` (None skipped) in place on every stage (a CPU tensor through the device)."""
        for tensor in filter(lambda t: t is not None, tensors):
            on_device = tensor.to(self.env.device)
            dist.broadcast(on_device, group=self.group, group_src=self.last_rank)
            tensor.copy_(on_device)

    def clip_gradients(self, max_norm: float | None) -> float:
        """Clip the gradients of every stage's parameters by their global norm (over stages and shards)."""
        parameters = [p for p in self.policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in parameters])
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squared = (norm.double() ** 2).reshape(1).to(self.env.device)
        dist.all_reduce(squared, group=self.group)
        total = squared.sqrt().to(norm.dtype).reshape(())
        if max_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
        return float(total)

    def step_metrics(self) -> dict[str, float]:
        """The last run's bubble (the fraction of its wall time each stage computed nothing) and each rank's peak
        memory (device bytes allocated; the process's peak resident set on a CPU), by pp rank."""
        busy, wall = self.timing
        if self.env.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.env.device)
            torch.cuda.reset_peak_memory_stats(self.env.device)
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes
        mine = torch.tensor([1.0 - busy / wall if wall > 0 else 0.0, float(peak)], dtype=torch.float64,
                            device=self.env.device)
        every = [torch.zeros_like(mine) for _ in range(self.env.pp_size)]
        dist.all_gather(every, mine, group=self.group)
        metrics = {"pp_bubble": sum(float(b[0]) for b in every) / len(every),
                   "pp_bubble_max": max(float(b[0]) for b in every)}
        for rank, (bubble, memory) in enumerate(t.tolist() for t in every):
            metrics[f"pp_rank{rank}_bubble"] = bubble
            metrics[f"pp_rank{rank}_peak_memory_mb"] = memory / 2**20
        return metrics


def _cut(output: Any, shape: torch.Size, entropy: bool, values: bool, entropy_grad: bool) -> PolicyOutput:
    """The last stage's outputs of one micro-batch, cut to its rows and columns, as run_policy hands them out."""
    rows, width = shape
    output = output if isinstance(output, tuple) else (output,)
    logprobs = output[0][:rows, : width - 1]
    entropies = output[1][:rows, : width - 1] if entropy else None
    if entropies is not None and not (entropy_grad and torch.is_grad_enabled()):
        entropies = entropies.detach()
    value = output[-1][:rows, : width - 1, 0].float() if values else None
    return PolicyOutput(logprobs, entropies, value)
