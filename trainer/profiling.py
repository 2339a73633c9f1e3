"""Profiler captures on demand: `profile.steps: [first, last]` records those steps with torch.profiler and writes a
Chrome trace per rank into `profile.dir`. With profile.steps unset, `step_profiler` returns None and the loop makes
no profiler object at all.

A capture spans the steps' stage-report intervals (trainer/stages.py): it starts at the report of step first - 1
(at the loop's start for step 1) and ends at the report of step `last`, so it holds their data waits, publishes and
checkpoints as well as their compute.
"""

import logging
import pathlib

import torch

from trainer.config.profile import ProfileConfig

log = logging.getLogger(__name__)


class StepProfiler:
    def __init__(self, config: ProfileConfig, rank: int, device: torch.device) -> None:
        self.first, self.last = config.steps
        self.path = pathlib.Path(config.dir) / f"trainer-rank{rank}-steps{self.first}-{self.last}.json"
        activities = [torch.profiler.ProfilerActivity.CPU] if "cpu" in config.activities else []
        if "cuda" in config.activities and device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.activities = activities
        self._profile: torch.profiler.profile | None = None

    def reported(self, step: int) -> None:
        """Step `step` was reported (0: the loop starts): start or end the capture there."""
        if step == self.first - 1 and self._profile is None:
            self._profile = torch.profiler.profile(activities=self.activities, record_shapes=True)
            self._profile.__enter__()
        elif step == self.last and self._profile is not None:
            self._profile.__exit__(None, None, None)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._profile.export_chrome_trace(str(self.path))
            self._profile = None
            log.info("profile of steps %d-%d written to %s", self.first, self.last, self.path)


def step_profiler(config: ProfileConfig, rank: int, device: torch.device) -> StepProfiler | None:
    return StepProfiler(config, rank, device) if config.steps is not None else None
