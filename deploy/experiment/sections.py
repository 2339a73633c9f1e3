"""Sections of the experiment file that the floors above it act on: where the curves go (deploy/record/loggers.py),
how the local launcher restarts what dies (deploy/local/supervisor.py), and when a deterministic run can hold
(deploy/rl/config.py). They live here, with the schema that reads them, so the file is checked when it is loaded.
"""

from typing import Literal

from pydantic import Field

from services.config import Strict


class WandbSection(Strict):
    """A Weights & Biases run for this run (the `wandb` library; log in first, or mode: offline)."""

    project: str = Field("relayrl", description="The W&B project.")
    entity: str | None = Field(None, description="The W&B team or user; None = your default.")
    name: str | None = Field(None, description="The W&B run's name; None = the run folder's name.")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="offline: written under dir/wandb/ only (`wandb sync` uploads it later).")
    tags: list[str] = Field(default_factory=list)
    dir: str | None = Field(None, description="Where the wandb/ folder goes; None = the run folder.")


class MlflowSection(Strict):
    """An MLflow run for this run (the `mlflow` library; `mlflow-skinny` suffices)."""

    tracking_uri: str | None = Field(None, description="An MLflow server (http://host:5000), a database "
                                     "(sqlite:///mlflow.db: the full `mlflow` package) or a folder (file:///...); "
                                     "None = $MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns.")
    experiment: str = Field("relayrl", description="The MLflow experiment (made if missing).")
    run_name: str | None = Field(None, description="None = the run folder's name.")


class LoggingSection(Strict):
    """Where the run's curves go, besides its JSONL files."""

    tensorboard: bool = Field(True, description="Event files in RUN_DIR/tensorboard/.")
    wandb: WandbSection | None = Field(None, description="A Weights & Biases run; None = off.")
    mlflow: MlflowSection | None = Field(None, description="An MLflow run; None = off.")


class SuperviseConfig(Strict):
    """How the local launcher restarts what dies."""

    max_restarts: int = Field(3, ge=0, description="Restarts of one process within restart_window_s; one more "
                              "death fails the run (non-zero exit naming it).")
    restart_window_s: float = Field(600.0, gt=0, description="The window max_restarts counts over.")
    backoff_s: float = Field(1.0, ge=0, description="Wait before a restart, doubled for each consecutive failed "
                             "start, at most 30 s.")
    health_interval_s: float = Field(1.0, gt=0, description="Seconds between health checks of a service.")
    health_timeout_s: float = Field(15.0, gt=0, description="A service unanswered for this long is frozen: it is "
                                    "SIGKILLed and started again.")
    start_timeout_s: float = Field(120.0, gt=0, description="A (re)started process must serve within this.")


def deterministic_problems(max_staleness: int, rollout_replicas: int) -> list[str]:
    """Why a deterministic run cannot hold for these settings (none: it can)."""
    problems = []
    if max_staleness:
        problems.append(f"deterministic: needs max_staleness 0, not {max_staleness}: generation running ahead of "
                        "training overlaps the steps, and which weight version generates a group (and what the rollout "
                        "batches it with) then depends on timing")
    if rollout_replicas > 1:
        problems.append(f"deterministic: needs one rollout process, not {rollout_replicas} replicas: the router "
                        "spreads requests by load, which depends on timing")
    return problems
