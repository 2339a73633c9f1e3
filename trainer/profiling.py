"""Profiler captures on demand: `profile.steps: [first, last]` records those steps with torch.profiler and writes a
Chrome trace per rank into `profile.dir`; so does a request a live run finds there (`relayrl profile RUN_DIR
--steps N` writes `profile.dir/request.json`: {"first": F, "last": L}, absolute steps every rank reads alike).
Without profile.dir, `step_profiler` returns None; with it, the loop's StepProfiler stats the request file once a
step, and no torch profiler object exists outside a capture.

NVTX ranges on a CUDA device: the stage clock (trainer/stages.py) opens one range per stage it enters (`stage/<name>`)
during a capture, and for the whole run with `profile.nvtx` (an nsys capture then reads like the stage report).
Otherwise the clock holds no ranges and makes no NVTX call.

A capture spans the steps' stage-report intervals (trainer/stages.py): it starts at the report of step first - 1
(at the loop's start for step 1) and ends at the report of step `last`, so it holds their data waits, publishes and
checkpoints as well as their compute.
"""

import json
import logging
import pathlib

import torch

from trainer.config.profile import ProfileConfig

log = logging.getLogger(__name__)
REQUEST = "request.json"


def trace_name(rank: int, first: int, last: int) -> str:
    return f"trainer-rank{rank}-steps{first}-{last}.json"


class NvtxRanges:
    """One open NVTX range, the stage's the clock is in: entering a stage closes the last one's."""

    def __init__(self) -> None:
        self.open = False

    def enter(self, stage: str) -> None:
        if self.open:
            torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_push(f"stage/{stage}")
        self.open = True

    def close(self) -> None:
        if self.open:
            torch.cuda.nvtx.range_pop()
            self.open = False


def nvtx_ranges(config: ProfileConfig, device: torch.device, capturing: bool) -> NvtxRanges | None:
    """The stage clock's NVTX ranges: on a CUDA device, during a capture or with profile.nvtx; else None."""
    return NvtxRanges() if device.type == "cuda" and (capturing or config.nvtx) else None


class StepProfiler:
    def __init__(self, config: ProfileConfig, rank: int, device: torch.device, clock=None) -> None:
        self.config, self.device, self.clock = config, device, clock  # clock: the loop's StageClock (NVTX ranges)
        self.dir, self.rank = pathlib.Path(config.dir), rank
        self.plan: tuple[int, int] | None = tuple(config.steps) if config.steps is not None else None
        activities = [torch.profiler.ProfilerActivity.CPU] if "cpu" in config.activities else []
        if "cuda" in config.activities and device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.activities = activities
        self._profile: torch.profiler.profile | None = None
        self._served: int | None = None  # the request taken last (its file's mtime)

    def reported(self, step: int) -> None:
        """Step `step` was reported (0: the loop starts): start or end a capture there."""
        if self._profile is not None:
            if step == self.plan[1]:
                self._finish()
            return
        if self.plan is None or step >= self.plan[1]:
            self._take_request(step)
        if self.plan is not None and step == self.plan[0] - 1:
            self._profile = torch.profiler.profile(activities=self.activities, record_shapes=True)
            self._profile.__enter__()
            self._set_ranges(capturing=True)

    def _take_request(self, step: int) -> None:
        path = self.dir / REQUEST
        try:
            stamp = path.stat().st_mtime_ns
        except FileNotFoundError:
            return
        if stamp == self._served:
            return
        self._served = stamp
        request = json.loads(path.read_text())
        first = max(int(request["first"]), step + 1)  # seen late: from the next step, as many steps
        self.plan = (first, first + int(request["last"]) - int(request["first"]))

    def _set_ranges(self, capturing: bool) -> None:
        if self.clock is not None:
            if self.clock.ranges is not None:
                self.clock.ranges.close()
            self.clock.ranges = nvtx_ranges(self.config, self.device, capturing)

    def _finish(self) -> None:
        self._set_ranges(capturing=False)
        self._profile.__exit__(None, None, None)
        first, last = self.plan
        path = self.dir / trace_name(self.rank, first, last)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(path))
        self._profile = None
        log.info("profile of steps %d-%d written to %s", first, last, path)


def step_profiler(config: ProfileConfig, rank: int, device: torch.device, clock=None) -> StepProfiler | None:
    return StepProfiler(config, rank, device, clock) if config.dir is not None else None
