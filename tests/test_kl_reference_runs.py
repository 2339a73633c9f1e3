"""Issue 41 as a user meets it, with real runs of the quickstart's project (`relayrl run FILE`, every service a process):
GRPO with a KL term and no reference named trains against the model RL starts from (its SFT output), with the KL in
every step's metrics; and a run whose trainer raises on its first batch is a failed run (non-zero exit, the exception's
last line in its summary and summary.json), which `relayrl doctor RUN_DIR` names as the cause and nothing else."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import yaml

from deploy.experiment.quickstart import write_project

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Short: a few SFT steps (the reference is then RUN_DIR/model-sft), a few RL steps, 20 held-out prompts.
QUICK = ["sft.steps=20", "data.num_eval=20", "training.time_budget_s=40", "evaluation.every_s=100"]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> pathlib.Path:
    return write_project(tmp_path_factory.mktemp("quickstart") / "project")


def relayrl(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "deploy", *args], capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=400, check=False)


def run(project: pathlib.Path, run_dir: pathlib.Path, *overrides: str) -> subprocess.CompletedProcess:
    sets = [f"--set={item}" for item in [f"run_dir={run_dir}", *QUICK, *overrides]]
    return relayrl("run", str(project), *sets, cwd=run_dir.parent)


def steps(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / "trainer_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_grpo_with_a_kl_term_and_no_reference_trains_against_its_start(project, tmp_path):
    """kl_coef 0.04 (DeepSeekMath's) with no reference named: the trainer loads the SFT output as its frozen
    reference and computes the reference logprobs itself. It died on its first batch ("needs reference logprobs"),
    took 0 optimizer steps, and the run exited 0."""
    run_dir = tmp_path / "run"
    done = run(project, run_dir, "algorithm.kl_coef=0.04", "training.max_steps=20", "sft.steps=120")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trained = steps(run_dir)
    assert trained and trained[-1]["step"] == 20, done.stdout[-3000:]
    assert all("kl" in step and step["kl"] >= 0 for step in trained), trained[-1]
    assert trained[0]["kl"] < 1e-6 < trained[-1]["kl"], [step["kl"] for step in trained]  # it starts as its reference
    assert yaml.safe_load((run_dir / "trainer.yaml").read_text())["ref_model_path"] == str(run_dir / "model-sft")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["failure"] is None and summary["steps"] == 20 and not summary["restarts"]
    print(f"kl_coef 0.04: {len(trained)} steps, kl {trained[0]['kl']:.4g} -> {trained[-1]['kl']:.4g}, held-out "
          f"{summary['sft_accuracy']:.3f} -> {summary['final_accuracy']:.3f}")


# The trainer's first step finds the rollout's logprobs further from its own than a bound no run stays under: it
# raises (trainer/mismatch.py: MismatchTooLarge) before the step is recorded, every time it starts.
RAISES_ON_FIRST_BATCH = ["services.trainer.settings.mismatch.metric=abs_max",
                         "services.trainer.settings.mismatch.stop_above=1.0e-12"]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("restarts", [0, 8])
def test_a_run_whose_trainer_raises_on_its_first_batch_is_a_failed_run(project, tmp_path, restarts):
    """restarts 0: the first death exhausts the restarts; 8: the budget runs out with the trainer restarting. Either
    way no optimizer step: the run exits 1 and its summary names the exception's last line, which the doctor quotes
    as the cause without "every completion scored 0". It exited 0 ("optimizer steps 0") when the budget ran out, and
    wrote no summary when the restarts did."""
    run_dir = tmp_path / "run"
    done = run(project, run_dir, *RAISES_ON_FIRST_BATCH, f"supervise.max_restarts={restarts}",
               "training.time_budget_s=25")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "relayrl run failed" in done.stderr and "MismatchTooLarge" in done.stderr, done.stderr[-3000:]
    assert "FAILED" in done.stdout and "MismatchTooLarge" in done.stdout, done.stdout[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 0 and "MismatchTooLarge: step 0" in summary["failure"], summary["failure"]
    assert "logs/trainer.log:" in summary["failure"]
    assert ("its restarts are exhausted" if restarts == 0 else "the trainer took no optimizer step") in \
        summary["failure"]

    doctor = relayrl("doctor", str(run_dir), cwd=tmp_path)
    assert doctor.returncode == 1, doctor.stdout
    errors = [line for line in doctor.stdout.splitlines() if line.startswith("ERROR")]
    assert errors[0].startswith("ERROR outcome: the run could not train") and "MismatchTooLarge" in errors[0], errors
    assert "scored 0" not in doctor.stdout and "took no optimizer step\n" not in doctor.stdout, doctor.stdout
    assert not [line for line in errors if line.startswith(("ERROR rewards", "ERROR weight versions"))], errors
    # A failed run is not finished: `relayrl run --resume` goes on once the cause is fixed.
    from deploy.record.run_state import finished

    assert not finished(run_dir)
