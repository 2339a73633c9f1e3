"""The test that matters: the whole pipeline, as real processes, makes reward go up (the quickstart experiment:
deploy/experiment/quickstart_experiment.yaml on the project deploy/experiment/quickstart.py writes)."""

import io
import json
import statistics

import pytest
from rich.console import Console

from deploy.experiment.quickstart import write_project
from deploy.experiment.schema import load_experiment
from deploy.runs.experiment_run import run_experiment


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_async_grpo_raises_mean_reward(tmp_path):
    config = load_experiment(write_project(tmp_path / "project"), [
        f"run_dir={tmp_path / 'run'}", "sft.steps=450", "training.time_budget_s=100", "evaluation.every_s=30",
    ])
    summary = run_experiment(config, console=Console(file=io.StringIO(), width=120))

    steps = [json.loads(line) for line in (tmp_path / "run" / "trainer_metrics.jsonl").read_text().splitlines()]
    assert len(steps) >= 60, f"only {len(steps)} optimizer steps in the budget"
    window = max(20, len(steps) // 4)
    early = statistics.mean(s["reward_mean"] for s in steps[:window])
    late = statistics.mean(s["reward_mean"] for s in steps[-window:])
    assert late > early + 0.03, f"mean reward did not rise: first {window} steps {early:.3f}, last {late:.3f}"
    assert max(s["staleness_max"] for s in steps) <= config.training.max_staleness
    assert (tmp_path / "run" / "progress.png").stat().st_size > 0
    assert summary.completions > 0 and summary.sft_accuracy > 0
