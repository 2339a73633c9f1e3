"""The `profile:` section of the trainer config: PyTorch Profiler captures of chosen steps."""

from pydantic import Field, model_validator

from services.config import Strict


class ProfileConfig(Strict):
    """Which steps to capture with torch.profiler, and where the traces go (docs/observability.md)."""

    steps: tuple[int, int] | None = Field(
        None, description="[first, last] optimizer steps (1-based, inclusive) to capture: from the report of the step "
        "before `first` to the report of `last`, the stage reports' intervals (trainer/stages.py). None = off: no "
        "profiler object is made.")
    dir: str | None = Field(None, description="Folder for the traces (trainer-rank<R>-steps<A>-<B>.json, Chrome "
                            "trace format: ui.perfetto.dev), where a live run also finds `relayrl profile`'s requests "
                            "(checked once a step); an experiment run sets RUN_DIR/profiles. None: no captures.")
    nvtx: bool = Field(False, description="NVTX ranges around every step's stages (stage/<name>, trainer/stages.py) "
                       "on a CUDA device, for an nsys capture of the whole run; during a torch.profiler capture they "
                       "are on regardless. Off (and no capture): no NVTX call is made.")
    activities: list[str] = Field(default_factory=lambda: ["cpu", "cuda"], description="What to record: cpu, cuda "
                                  "(cuda only where the trainer computes on a CUDA device).")

    @model_validator(mode="after")
    def _check(self) -> "ProfileConfig":
        if self.steps is not None:
            first, last = self.steps
            if not 1 <= first <= last:
                raise ValueError(f"profile.steps: [first, last] with 1 <= first <= last, got {list(self.steps)}")
            if self.dir is None:
                raise ValueError("profile.steps: set profile.dir, the folder its traces go to")
        unknown = set(self.activities) - {"cpu", "cuda"}
        if unknown:
            raise ValueError(f"profile.activities: {sorted(unknown)} unknown (cpu, cuda)")
        return self
