"""The `mismatch:` section of the trainer config: how far the rollout's logprobs may drift from the trainer's."""

from typing import Literal

from pydantic import Field

from services.config import Strict


class MismatchConfig(Strict):
    """A bound on the rollout-vs-trainer logprob mismatch measured every step (trainer/mismatch.py).

    Engines and trainer compute the same tokens' logprobs with different kernels (and, in bf16, a different LM
    head precision); the drift is the first thing to look at when a run becomes unstable."""

    metric: Literal["abs_mean", "abs_max", "k3"] = Field(
        "abs_mean", description="The figure the bound applies to: mean or max |rollout - trainer logprob| over the "
        "trained tokens, or the k3 estimate of KL(rollout || trainer).")
    warn_above: float | None = Field(None, gt=0, description="Log a warning on a step whose figure is above this.")
    stop_above: float | None = Field(None, gt=0, description="Stop the run (an error naming the step and the "
                                     "figure) on a step whose figure is above this. None = never.")
