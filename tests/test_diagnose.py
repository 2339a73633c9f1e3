"""`relayrl doctor RUN_DIR` over run folders: trimmed copies of real runs broken on purpose (tests/data/runs/, made by
tests/broken_runs.py) name their seeded fault; a healthy run names none; folders written here seed the faults no
run of this machine shows (out of memory, a collective timeout, entropy collapse, a mismatch spike)."""

import json
import pathlib

import pytest

from deploy.cli import main as relayrl
from deploy.inspect.diagnose import diagnose_run

RUNS = pathlib.Path(__file__).resolve().parent / "data" / "runs"


def named(findings, level: str) -> dict[str, str]:
    """check -> message of the findings at `level`."""
    return {f.check: f.message + " | " + " | ".join(f.evidence) + " | " + f.fix for f in findings if f.level == level}


def test_a_healthy_run_has_no_fault(capsys):
    assert relayrl(["doctor", str(RUNS / "healthy")]) == 0
    out = capsys.readouterr().out
    assert "ERROR" not in out and "OK    outcome: finished" in out, out
    assert "as the policy converged on its best reward" in out  # entropy fell, and that is no collapse here
    assert "mismatch" not in out  # the run records no mismatch metrics: nothing said about them


def test_a_trainer_killed_until_its_restarts_ran_out_is_a_restart_loop(capsys):
    assert relayrl(["doctor", str(RUNS / "killed_trainer")]) == 1
    errors = named(diagnose_run(RUNS / "killed_trainer"), "error")
    assert "the run failed: trainer exited with code -9, and its restarts are exhausted" in errors["outcome"]
    loop = errors["restart loop"]
    assert "trainer went down 3 times (exited with code -9 x3)" in loop, loop
    assert "supervisor.jsonl:1: member trainer, event down" in loop and "logs/trainer.log: 3 starts" in loop
    assert "OOM killer" in loop  # what a -9 usually is


def test_a_reward_that_is_always_zero(capsys):
    errors = named(diagnose_run(RUNS / "zero_reward"), "error")
    assert list(errors) == ["rewards"], errors
    assert "every completion of all 40 trained batches scored 0" in errors["rewards"]
    assert "trainer_metrics.jsonl:1-40: reward_mean 0" in errors["rewards"] and "grad_norm 0" in errors["rewards"]
    assert "reward_sum 0" in errors["rewards"]


def test_a_publish_that_never_succeeds(capsys):
    errors = named(diagnose_run(RUNS / "publish_refused"), "error")
    assert list(errors) == ["weight versions"], errors
    found = errors["weight versions"]
    assert "no weight version reached the rollout: the publishes of versions 1-2 failed" in found, found
    assert "logs/trainer.log:3:" in found and "Connection refused" in found
    assert "highest version served: 0" in found
    assert "publish.receivers ['127.0.0.1:50933'], but services.json: the rollout listens at ['127.0.0.1:42437']" in found
    assert "drop publish.receivers from services.trainer.settings" in found


def steps(run: pathlib.Path, records: list[dict]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    (run / "trainer_metrics.jsonl").write_text("".join(json.dumps({"step": i, **r}) + "\n"
                                                       for i, r in enumerate(records, 1)))


def test_out_of_memory_and_a_collective_timeout_in_the_logs(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "trainer.log").write_text(
        "2026-01-01 00:00:00,000 trainer[0] INFO rank 0 of 2 on cuda:0 (pid 7)\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.1 GiB total capacity)\n")
    (tmp_path / "logs" / "trainer-1.log").write_text(
        "[E ProcessGroupNCCL.cpp:475] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
        "OpType=BROADCAST, Timeout(ms)=1800000) ran for 1800009 milliseconds before timing out.\n")
    (tmp_path / "logs" / "rollout.log").write_text(
        "WARNING rollout.serve.weight_receiver: receiving weight version 4 failed: version 4: deadline passed before "
        "joining the group\n")
    errors = named(diagnose_run(tmp_path), "error")
    assert "logs/trainer.log:2: torch.OutOfMemoryError: CUDA out of memory" in errors["out of memory"]
    assert "2 log lines say a collective" in errors["collective timeout"]
    assert "logs/rollout.log:1:" in errors["collective timeout"] and "logs/trainer-1.log:1:" in errors["collective timeout"]


def test_entropy_collapse_before_the_reward_got_anywhere(tmp_path):
    steps(tmp_path, [{"entropy": 3.0 * 0.8 ** i, "reward_mean": 0.3 + 0.01 * (i % 3)} for i in range(40)])
    warnings = named(diagnose_run(tmp_path), "warn")
    assert "entropy collapse" in warnings, warnings
    assert "policy entropy fell from" in warnings["entropy collapse"]
    assert "algorithm.entropy_coef" in warnings["entropy collapse"]


def test_a_constant_reward(tmp_path):
    steps(tmp_path, [{"reward_mean": 1.0, "grad_norm": 0.0} for _ in range(12)])
    errors = named(diagnose_run(tmp_path), "error")
    assert "the reward is constant at 1 over 12 batches" in errors["rewards"]


def test_mismatch_spikes_when_the_run_records_mismatch(tmp_path):
    records = [{"mismatch/kl": 0.01 + 0.001 * (i % 4), "mismatch/max_abs_logprob_diff": 0.2} for i in range(30)]
    records[17]["mismatch/kl"] = 0.9
    steps(tmp_path, records)
    findings = diagnose_run(tmp_path)
    spikes = named(findings, "warn")["mismatch spikes"]
    assert "mismatch/kl spiked at 1 steps (up to 0.9" in spikes and "trainer_metrics.jsonl:18: step 18" in spikes
    assert "mismatch/max_abs_logprob_diff: median 0.2, no spike over 30 steps" in named(findings, "ok")["mismatch"]


def test_a_healthy_quickstart_run_gets_no_warning(capsys):
    """tests/data/runs/healthy_quickstart: a trimmed copy of a healthy quickstart run (150 s of RL, held-out 0.205 ->
    0.590, max_staleness 1; tests/broken_runs.py's trim, its trainer_metrics.jsonl cut to the first 30 and last 10
    steps, every 25th, and every step whose mismatch the doctor warned of). Its abs_max reached 1.65 (one step of
    policy change at lag 1), its lag-0 mean 0.037 (tokens sampled over KV kept across an update): "mismatch spikes"
    before, judged by lag now."""
    assert relayrl(["doctor", str(RUNS / "healthy_quickstart")]) == 0
    out = capsys.readouterr().out
    assert "WARN" not in out and "ERROR" not in out, out
    assert "mismatch/abs_mean_lag1: median 0.0233, at most 0.0627" in out and "within the ratio the loss clips" in out


def _lagged(lag0: float, lag1: float, **spikes) -> list[dict]:
    """30 steps of the trainer's mismatch figures: the lag-0 and lag-1 means, abs_max 10x the lag-1 mean; `spikes`:
    {step index: (key, value)}."""
    records = [{"mismatch/abs_mean_lag0": lag0 * (1 + 0.1 * (i % 3)), "mismatch/abs_mean_lag1": lag1 * (1 + 0.1 * (i % 4)),
                "mismatch/abs_mean": lag1, "mismatch/abs_max": 10 * lag1 * (1 + 0.1 * (i % 5)), "mismatch/k3": lag1 ** 2}
               for i in range(30)]
    for index, (key, value) in spikes.items():
        records[int(index)][key] = value
    return records


@pytest.mark.parametrize(("records", "warned"), [
    # The rollout serves the weights cast (publish.dtype) or computes in bf16 against a float32 trainer: every
    # lag-0 step is off, by a level no spike shows.
    (_lagged(0.02, 0.03), "disagree on the same weights"),
    # One step's lag-0 tokens beyond the ratio the loss clips: the same weights disagreed there.
    (_lagged(2e-5, 0.03, **{"17": ("mismatch/abs_mean_lag0", 0.6)}), "abs_mean_lag0 went beyond the ratio"),
    # Sampled one version back, the typical token moved beyond the clip: too fast a policy for the staleness.
    (_lagged(2e-5, 0.03, **{"9": ("mismatch/abs_mean_lag1", 0.5)}), "out of its trust region"),
])
def test_a_real_rollout_trainer_disagreement_is_still_named(tmp_path, records, warned):
    steps(tmp_path, records)
    warnings = named(diagnose_run(tmp_path), "warn")
    assert any(warned in text for text in warnings.values()), warnings


def test_one_step_of_policy_change_is_no_mismatch_fault(tmp_path):
    """abs_max 3.5 at lag 1 (one step of policy change under max_staleness 1) and a lag-0 mean near kernel noise."""
    steps(tmp_path, _lagged(2e-5, 0.03, **{"12": ("mismatch/abs_max", 3.5)}))
    assert "mismatch spikes" not in named(diagnose_run(tmp_path), "warn")


def test_a_served_weight_version_that_stops_moving(tmp_path):
    steps(tmp_path, [{"reward_mean": 0.1 * (i % 5), "weight_version": i} for i in range(1, 31)])
    (tmp_path / "driver_stats.jsonl").write_text("".join(
        json.dumps({"elapsed_s": 2.0 * i, "version": min(i, 10), "samples": 64 * i}) + "\n" for i in range(1, 31)))
    warning = named(diagnose_run(tmp_path), "warn")["weight versions"]
    assert "stopped moving: version 10 served for the last 40s of the driver's 60s" in warning, warning
    assert "driver_stats.jsonl:10-30" in warning


def test_doctor_takes_no_overrides_for_a_run_folder(capsys):
    assert relayrl(["doctor", str(RUNS / "healthy"), "--set", "training.lr=1"]) == 2
    assert "--set overrides an experiment file" in capsys.readouterr().err


@pytest.mark.parametrize("missing", ["nothing", "everything"])
def test_a_folder_that_is_no_run_yet(tmp_path, missing, capsys):
    if missing == "nothing":
        (tmp_path / "logs").mkdir()
    assert relayrl(["doctor", str(tmp_path)]) == 0
    assert "the run did not finish (no summary.json)" in capsys.readouterr().out
