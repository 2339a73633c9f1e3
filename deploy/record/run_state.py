"""What a run folder keeps so that `relayrl run --resume RUN_DIR` can go on where the run stopped.

    config.yaml         the resolved config (written at the start; the resume reads it); owner-only (0600): an
                        experiment's client tokens are in it
    model-sft/          the SFT warm-up's output, renamed into place once whole (a resume skips SFT then)
    buffer/             the buffer's log (the restarted buffer recovers it)
    checkpoints/        the trainer's checkpoints with their ledgers (the restarted trainer resumes from the latest)
    driver_position.json  where the driver stands in the prompt stream (rollout/driver/position.py)
    rl_clock.json       seconds of RL spent so far (the time budget counts them)
    metrics.jsonl, trainer_metrics.jsonl, driver_stats.jsonl   appended to: the curve goes on
    summary.json        written last: the run ended; it finished unless its `failure` says why it could not train
                        (a run that failed can be resumed once the cause is fixed)
"""

import dataclasses
import json
import os
import pathlib
import shutil
from dataclasses import dataclass, field

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
RL_CLOCK_FILE = "rl_clock.json"


@dataclass
class Summary:
    """What a run reached (summary.json): the held-out metric (an experiment's: mean reward) at the start of RL,
    after SFT, at its end and at its best (None: not measured, the run failed first), and the work done. `failure`:
    why the run could not train (no optimizer step, or a process whose restarts ran out), with the last error line of
    the process's log; None = it trained. `performance`: the stage reports' summary (deploy/record/performance.py)."""

    seed: int
    sft_accuracy: float | None
    final_accuracy: float | None
    best_accuracy: float | None
    steps: int
    completions: int
    rl_seconds: float
    curve: list[dict] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    run_dir: str = ""
    failure: str | None = None
    # where the time went, from the stage reports (deploy/record/performance.py); empty: none recorded
    performance: dict = field(default_factory=dict)


def start_run_dir(run_dir: pathlib.Path, config: dict, seed: int, resume: bool) -> None:
    """A fresh run replaces `run_dir` and records its config; a resumed one keeps everything but the summary of a
    failed attempt (the run is going on: it writes its own at the end) and adds its provenance to the record."""
    import yaml

    from deploy.record.private_files import write_private
    from deploy.record.provenance import write_provenance

    if not resume:
        if run_dir.exists():
            shutil.rmtree(run_dir)
        (run_dir / "logs").mkdir(parents=True)
        write_private(run_dir / CONFIG_FILE, yaml.safe_dump(config, sort_keys=False), private_folder=False)
    else:
        (run_dir / SUMMARY_FILE).unlink(missing_ok=True)  # resumed: not finished, so a failed attempt's
    write_provenance(run_dir, seed, resumed=resume)


def whole_model(folder: pathlib.Path) -> bool:
    """Whether `folder` holds a finished Hugging Face export (trainer.checkpoint.export_hf renames it into place
    once written); a crashed export's staging folder beside it is removed."""
    for staging in folder.parent.glob(f".tmp-{folder.name}-*"):
        shutil.rmtree(staging)
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def rl_seconds(run_dir: pathlib.Path) -> float:
    """Seconds of RL the run has spent so far (0 before RL started)."""
    path = run_dir / RL_CLOCK_FILE
    return json.loads(path.read_text())["rl_seconds"] if path.exists() else 0.0


def save_rl_seconds(run_dir: pathlib.Path, seconds: float) -> None:
    staging = run_dir / f".{RL_CLOCK_FILE}.tmp"
    staging.write_text(json.dumps({"rl_seconds": round(seconds, 3)}))
    os.replace(staging, run_dir / RL_CLOCK_FILE)


def write_summary(run_dir: pathlib.Path, summary: Summary) -> None:
    """The run's summary: its presence says the run finished."""
    (run_dir / SUMMARY_FILE).write_text(json.dumps(dataclasses.asdict(summary), indent=1) + "\n")


def finished(run_dir: pathlib.Path) -> bool:
    """Whether the run ended having trained (a summary that names no failure)."""
    path = run_dir / SUMMARY_FILE
    return path.is_file() and not json.loads(path.read_text()).get("failure")
