"""Per-stage step reports: where each rank's time goes, step by step, with no "other" bucket.

A rank's loop is always in exactly one stage; `StageClock.switch` moves it on and charges the time since the last
switch to the stage it leaves. So a step's stages sum to its interval by construction. The interval of step N is
the time from step N-1's report (or the start of training) to step N's report, the moment its metrics line is
written; it holds, in order:

- publish, pause, checkpoint: the weight publish and the checkpoint that followed step N-1 (they delay step N).
  pause is the part of a blocking publish (publish.overlap false) the trainer waited while the engines were paused
  (the receivers' CommitUpdateResponse pause_s); an overlapped publish's pause is off the trainer's path.
- data_wait: waiting for the batch (the pull, or the prefetched pull's remainder), handing it to every rank, its
  staleness check, and after the step the lease bookkeeping (marking it consumed, starting the next prefetch).
- forward: the batch's preparation (samples into tensors; recomputed and reference logprobs, which are forward
  passes) and each micro-batch's forward pass, loss and metrics; backward: each micro-batch's backward;
  optimizer: clipping, the optimizer step, the metrics' all-reduce and the step's mismatch check.

On CUDA each switch synchronises the device, so kernels are charged to the stage that launched them (a few
synchronisations per micro-batch). Reported as `stage/<name>_s` (rank 0) and `stage/<name>_s/rank<r>` for the other
ranks (stragglers show), `stage/step_s` (the interval), `stage/report_time` (its end, seconds since the epoch),
and the utilisation of the step (services/flops.py):
`perf/flops` (rank 0's count), `perf/flops_per_s` over the interval, `perf/mfu` over the device's peak; and
`perf/tokens` (the tokens every rank's micro-batches ran over, summed; `perf/devices` the ranks), `perf/peak_memory_gb`
(and `/rank<r>`: torch's peak allocation on an accelerator, the process's peak resident set on the CPU).
"""

import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from services.device import peak_memory
from services.flops import FlopModel, device_peak

STAGES = ("data_wait", "forward", "backward", "optimizer", "publish", "pause", "checkpoint")


class StageClock:
    """Charges every moment of one rank's training loop to one stage."""

    def __init__(self, device: torch.device | None = None, lm: torch.nn.Module | None = None, tp_size: int = 1) -> None:
        self.flop_model = FlopModel.of_module(lm, tp_size) if lm is not None else None
        self._sync = device is not None and device.type == "cuda"
        self._device = device
        self.current = "data_wait"
        self._since = time.perf_counter()
        self.totals = dict.fromkeys(STAGES, 0.0)
        self.flops = 0.0
        self.tokens = 0  # tokens the micro-batches' forward and backward ran over (padding left out)
        self.ranges = None  # NVTX ranges (trainer/profiling.py: NvtxRanges) while profiling on CUDA; None: no call

    def switch(self, stage: str) -> str:
        """Enter `stage`; the stage left (to switch back to)."""
        if stage not in self.totals:
            raise ValueError(f"unknown stage {stage!r}: one of {', '.join(STAGES)}")
        if self._sync:
            torch.cuda.synchronize(self._device)
        now = time.perf_counter()
        self.totals[self.current] += now - self._since
        self._since, left, self.current = now, self.current, stage
        if self.ranges is not None:
            self.ranges.enter(stage)
        return left

    @contextmanager
    def stage(self, name: str):
        left = self.switch(name)
        try:
            yield
        finally:
            self.switch(left)

    def backward(self, loss: torch.Tensor, shape: torch.Size, attention_mask: torch.Tensor | None = None) -> None:
        """A micro-batch's backward, as the backward stage; the FLOPs of its forward and backward over `shape`, and
        its tokens (those `attention_mask` keeps)."""
        with self.stage("backward"):
            loss.backward()
        if self.flop_model is not None:
            self.flops += self.flop_model.train(*shape)
        if attention_mask is not None:
            self.tokens += int(attention_mask.sum())

    def optimizer_step(self, optimizer: torch.optim.Optimizer, clip) -> float:
        """The optimizer stage, entered here: `clip()` the gradients (their norm returned), step, zero them."""
        self.switch("optimizer")
        grad_norm = clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def move(self, seconds: float, source: str, target: str) -> None:
        """Re-charge up to `seconds` of what `source` holds to `target` (the engines' pause inside a publish)."""
        moved = min(max(seconds, 0.0), self.totals[source])
        self.totals[source] -= moved
        self.totals[target] += moved

    def lap(self) -> dict[str, float]:
        """This rank's stages since the last lap (their sum: the step's interval), and the FLOPs counted; reset."""
        self.switch(self.current)
        report = {f"{name}_s": seconds for name, seconds in self.totals.items()}
        report["step_s"] = sum(self.totals.values())
        report["flops"], report["tokens"] = self.flops, self.tokens
        self.totals, self.flops, self.tokens = dict.fromkeys(STAGES, 0.0), 0.0, 0
        return report


def step_report(clock: StageClock, device: torch.device, distributed: bool) -> dict[str, float]:
    """The step's stage report on every rank (collective when distributed: the ranks' reports are gathered)."""
    mine = {**clock.lap(), "peak_memory": peak_memory(device)}
    ranks = [mine]
    if distributed:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    report = {f"stage/{name}": value for name, value in mine.items() if name.endswith("_s")}
    report["stage/report_time"] = time.time()  # the interval's end by the wall clock: consecutive ones bound it
    report["perf/peak_memory_gb"] = mine["peak_memory"] / 1e9
    for rank, theirs in enumerate(ranks[1:], start=1):
        report.update({f"stage/{name}/rank{rank}": value for name, value in theirs.items() if name.endswith("_s")})
        report[f"perf/peak_memory_gb/rank{rank}"] = theirs["peak_memory"] / 1e9
    report["perf/tokens"] = sum(theirs["tokens"] for theirs in ranks)  # every rank's: per device, over len(ranks)
    report["perf/devices"] = len(ranks)
    peak, _ = device_peak(device)
    flops_per_s = mine["flops"] / mine["step_s"] if mine["step_s"] > 0 else 0.0
    report.update({"perf/flops": mine["flops"], "perf/flops_per_s": flops_per_s, "perf/peak_flops": peak,
                   "perf/mfu": flops_per_s / peak})
    return report
