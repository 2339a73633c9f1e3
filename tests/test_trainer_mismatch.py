"""Rollout-vs-trainer logprob mismatch, reported every step (trainer/mismatch.py): by hand, through a real step of
the learner on the tiny model, and its bound (warn or stop)."""

import json
import math

import numpy as np
import pytest
import torch

from tests.test_trainer_step import config, local, make_samples, with_true_logprobs
from trainer.config.mismatch import MismatchConfig
from trainer.learner import Learner
from trainer.mismatch import MismatchTooLarge, check_mismatch, mismatch_metrics, mismatch_sums


def test_mismatch_figures_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-1.0, -1.0, -1.0, -1.0]])
    rollout = torch.tensor([[-1.5, -2.0, -2.0, -9.0], [-1.2, -1.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # the -9 is masked out
    versions = torch.tensor([[5, 5, 4, 4], [2, 2, 2, 2]])
    sums, largest = mismatch_sums(trainer, rollout, mask, versions, version=5)
    totals = {name: float(value) for name, value in sums.items()} | {"loss": 1.0}
    metrics = mismatch_metrics(totals, float(largest))
    assert totals == {"loss": 1.0}  # the raw sums are taken out
    diffs = [0.5, 0.0, -1.0, 0.2]  # trainer - rollout on the trained tokens
    assert metrics["mismatch/abs_mean"] == pytest.approx(sum(map(abs, diffs)) / 4)
    assert metrics["mismatch/abs_max"] == pytest.approx(1.0)
    assert metrics["mismatch/k3"] == pytest.approx(sum(math.expm1(d) - d for d in diffs) / 4)
    assert metrics["mismatch/abs_mean_lag0"] == pytest.approx(0.25)  # 0.5, 0.0
    assert metrics["mismatch/abs_mean_lag1"] == pytest.approx(1.0)
    assert metrics["mismatch/abs_mean_lag2+"] == pytest.approx(0.2)


def test_a_step_reports_zero_mismatch_on_its_own_logprobs_and_the_offset_otherwise(tiny_model_dir):
    learner = Learner(config(tiny_model_dir, algorithm={"name": "grpo"}), local())
    samples = with_true_logprobs(learner, make_samples())
    (batch,) = learner.prepare(samples)
    metrics = learner.train_step(batch, 0, version=0)
    assert metrics["mismatch/abs_mean"] < 1e-5 and metrics["mismatch/abs_max"] < 1e-5
    assert abs(metrics["mismatch/k3"]) < 1e-5 and "mismatch/abs_mean_lag0" in metrics

    learner = Learner(config(tiny_model_dir, algorithm={"name": "grpo"}), local())
    shifted = with_true_logprobs(learner, make_samples())
    for s in shifted:
        s.rollout_logprobs = (s.rollout_logprobs - 0.1).astype(np.float32)  # the rollout 0.1 nats less sure
    (batch,) = learner.prepare(shifted)
    metrics = learner.train_step(batch, 0, version=3)  # samples of version 0 at trainer version 3
    assert metrics["mismatch/abs_mean"] == pytest.approx(0.1, abs=1e-5)
    assert metrics["mismatch/k3"] == pytest.approx(math.expm1(0.1) - 0.1, abs=1e-5)
    assert metrics["mismatch/abs_mean_lag2+"] == pytest.approx(0.1, abs=1e-5) and "mismatch/abs_mean_lag0" not in metrics


def test_sft_reports_no_mismatch(tiny_model_dir):
    learner = Learner(config(tiny_model_dir, algorithm={"name": "sft"}), local())
    (batch,) = learner.prepare(make_samples())
    assert not any(name.startswith("mismatch/") for name in learner.train_step(batch, 0))


def test_the_bound_warns_or_stops(caplog):
    metrics = {"mismatch/abs_mean": 0.3, "mismatch/k3": 0.01}
    check_mismatch(MismatchConfig(), metrics, 1)  # no bound: nothing
    with caplog.at_level("WARNING"):
        check_mismatch(MismatchConfig(warn_above=0.2), metrics, 7)
    assert "step 7" in caplog.text and "abs_mean" in caplog.text
    with pytest.raises(MismatchTooLarge, match="k3 = 0.01 is above mismatch.stop_above = 0.005"):
        check_mismatch(MismatchConfig(metric="k3", stop_above=0.005), metrics, 9)
    check_mismatch(MismatchConfig(stop_above=1.0), {}, 2)  # SFT steps carry none


def test_relayrl_status_shows_the_trainers_last_mismatch(tmp_path):
    from rich.console import Console

    from deploy.inspect.status_table import report, table, trainer_summary

    assert trainer_summary(tmp_path) is None
    lines = [{"step": 1, "weight_version": 1, "loss": 0.5, "mismatch/abs_mean": 0.02, "mismatch/abs_max": 0.4,
              "mismatch/k3": 0.001},
             {"step": 2, "weight_version": 2, "loss": 0.4, "mismatch/abs_mean": 0.03, "mismatch/abs_max": 0.5,
              "mismatch/k3": 0.002}]
    (tmp_path / "trainer_metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"step": 3')
    summary = trainer_summary(tmp_path)
    assert summary == {"step": 2, "weight_version": 2, "mismatch/abs_mean": 0.03, "mismatch/abs_max": 0.5,
                       "mismatch/k3": 0.002}  # the half-written last line is skipped
    assert report([], summary)["trainer"]["mismatch/abs_mean"] == 0.03
    console = Console(width=200, record=True)
    console.print(table([], "relayrl status: run", summary))
    assert "mismatch mean 0.03, max 0.5, k3 0.002" in " ".join(console.export_text().split())


def test_the_step_figures_reach_prometheus():
    from prometheus_client import REGISTRY

    check_mismatch(MismatchConfig(), {"mismatch/abs_mean": 0.125, "mismatch/abs_mean_lag2+": 0.5, "loss": 1.0}, 4)
    value = REGISTRY.get_sample_value("relayrl_trainer_logprob_mismatch", {"stat": "abs_mean"})
    assert value == 0.125
    assert REGISTRY.get_sample_value("relayrl_trainer_logprob_mismatch", {"stat": "abs_mean_lag2+"}) == 0.5
