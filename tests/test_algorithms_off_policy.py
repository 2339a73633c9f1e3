"""Off-policy correction as configuration (off_policy, is_level, is_batch_normalize, rejection), through
Learner.prepare / train_step on the tiny model.

Where verl has the function, the expected values are verl b178a3cd56f58b2d502255daba591e92833930a7's own
(tests/data/reference/verl.json: rollout_corr_helper.compute_rollout_correction_weights and
compute_rollout_rejection_mask): the samples' rollout logprobs are set to the tiny model's own logprobs minus
the reference inputs' log-ratios, so the learner's recomputed log pi_prox - log pi_rollout is that log-ratio
(up to float32 rounding, hence 1e-5).
"""

import json
import pathlib

import numpy as np
import pytest
import torch
from test_algorithms_estimators import PROMPT, response, samples_from
from test_trainer_step import config, local, make_samples, with_true_logprobs

from trainer.batch import collate
from trainer.config.algorithm import AlgorithmConfig
from trainer.corrections import is_weight_moments
from trainer.learner import Learner
from trainer.losses import loss_weights
from trainer.model import run_policy

VERL = json.loads((pathlib.Path(__file__).parent / "data" / "reference" / "verl.json").read_text())
WEIGHTS = VERL["rollout_correction_weights"][0]
REJECTION = VERL["rollout_rejection_mask"][0]
ADVANTAGES = torch.tensor(VERL["inputs"]["advantages"], dtype=torch.float64)


def learner_for(model, micro_batch_size=1, **algorithm) -> Learner:
    """A learner that computes the proximal logprobs and weights in prepare (by a forward pass of its own), where
    these tests read them; with one step per batch it would take them from the step's forward (compared below)."""
    learner = Learner(config(model, algorithm=algorithm, batch={"global_batch_size": 8,
                                                                "micro_batch_size": micro_batch_size}), local())
    learner.proximal_in_step = False
    return learner


@pytest.mark.parametrize("off_policy,level", [("tis", "token"), ("tis", "sequence"), ("decoupled", "token"),
                                              ("recompute", "token")])
def test_one_step_per_batch_takes_the_proximal_logprobs_from_its_own_forward(tiny_model_dir, off_policy, level):
    """mini_batches 1: pi_prox is the policy the step starts from; the step's forward, detached, gives the same
    ratio and weights as a second forward pass (verl's on_policy path), and the second pass is not run."""
    samples = make_samples()
    results = []
    for in_step in (False, True):
        learner = Learner(config(tiny_model_dir, algorithm={"name": "grpo", "off_policy": off_policy, "is_level": level,
                                                            "is_cap": 1.5}), local())
        assert learner.proximal_in_step
        learner.proximal_in_step = in_step
        forwards = []
        learner.policy.register_forward_hook(lambda *_, seen=forwards: seen.append(1))
        for sample in samples:  # rollout logprobs off the policy's own: weights that are not all 1 or the cap
            sample.rollout_logprobs = np.full_like(sample.rollout_logprobs, -4.4)
        first = learner.train_step(learner.prepare(samples)[0], 0)
        second = learner.train_step(learner.prepare(samples)[0], 1)
        results.append([first[k] for k in ("loss", "grad_norm", "ratio", "is_weight") if k in first] +
                       [second["loss"], second["grad_norm"]])
        assert len(forwards) == (4 if in_step else 8), (in_step, len(forwards))  # 2 steps of 2 micro-batches
    np.testing.assert_allclose(results[1], results[0], rtol=0, atol=1e-6)
    # Rejection needs the whole mini-batch's logprobs before the step: it keeps the second pass.
    rejecting = learner_for(tiny_model_dir, off_policy="tis", rejection=[{"statistic": "token_k2", "upper": 0.02}])
    assert not Learner(rejecting.config, local()).proximal_in_step


def with_log_ratio(learner: Learner, samples, log_ratio) -> list:
    """Rollout logprobs = the policy's own minus `log_ratio`, so that log pi_prox - log pi_rollout = log_ratio."""
    samples = with_true_logprobs(learner, samples)
    for sample, row in zip(samples, log_ratio, strict=True):
        sample.rollout_logprobs = (sample.rollout_logprobs.astype(np.float64) - np.asarray(row)).astype(np.float32)
    return samples


def reference_samples(mask, rewards=(1.0, 0.0, 2.0, 1.0, 0.5)) -> list:
    return samples_from(list(rewards), [0, 0, 1, 1, 1], mask)


@pytest.mark.parametrize("case", WEIGHTS["cases"], ids=lambda c: f"{c['level']}-norm{c['normalize']}")
def test_truncated_importance_weights_equal_verl(tiny_model_dir, case):
    """tis = verl's rollout_is, token or sequence, truncated at 2, optionally batch-normalised."""
    log_ratio = torch.tensor(WEIGHTS["proximal"]) - torch.tensor(WEIGHTS["behaviour"])
    learner = learner_for(tiny_model_dir, off_policy="tis", is_level=case["level"],
                          is_batch_normalize=case["normalize"], is_cap=case["cap"])
    (mini_batch,) = learner.prepare(with_log_ratio(learner, reference_samples(WEIGHTS["mask"]), log_ratio.tolist()))
    torch.testing.assert_close(response(mini_batch.is_weights, 6), torch.tensor(case["weights"], dtype=torch.float64),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_masked_importance_weights_drop_what_verl_would_truncate(tiny_model_dir, level, normalize):
    """decoupled (masked IS) with cap 1.3: verl's untruncated ratios (its cap-2 weights here, none above 2)
    where they are at most 1.3, 0 above; normalised, they average 1 over the trained tokens or sequences."""
    log_ratio = torch.tensor(WEIGHTS["proximal"]) - torch.tensor(WEIGHTS["behaviour"])
    learner = learner_for(tiny_model_dir, off_policy="decoupled", is_level=level, is_batch_normalize=normalize, is_cap=1.3)
    (mini_batch,) = learner.prepare(with_log_ratio(learner, reference_samples(WEIGHTS["mask"]), log_ratio.tolist()))
    weights = response(mini_batch.is_weights, 6)
    raw = torch.tensor(next(c for c in WEIGHTS["cases"] if c["level"] == level and not c["normalize"])["weights"],
                       dtype=torch.float64)
    mask = torch.tensor(WEIGHTS["mask"], dtype=torch.float64)
    below = raw <= 1.3
    assert (~below).any() and (below & (mask > 0)).any()
    assert (weights[~below] == 0).all()  # above the cap: dropped, not truncated
    if normalize:
        moments = is_weight_moments(weights, mask, level)
        assert float(moments[0] / moments[1]) == pytest.approx(1.0, abs=1e-6)
    else:
        torch.testing.assert_close(weights[below], raw[below], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", REJECTION["cases"], ids=lambda c: f"{c['statistic']}-{c['threshold']}")
def test_rejection_equals_verl_and_leaves_the_normalisation(tiny_model_dir, case):
    """compute_rollout_rejection_mask on pi_prox vs pi_rollout: the learner's loss mask is verl's modified
    response mask; the loss weights are those of the kept tokens (verl aggregates over the modified mask); the
    first step's loss (ratio 1) is -sum(A * w) over the kept tokens, and the rejected tokens are counted."""
    rule = {"statistic": case["statistic"], "upper": case["upper"], "lower": case["lower"]}
    learner = learner_for(tiny_model_dir, off_policy="recompute", rejection=[rule], loss_agg="token_mean")
    samples = with_log_ratio(learner, reference_samples(REJECTION["mask"]), REJECTION["log_ratio"])
    (mini_batch,) = learner.prepare(samples)
    kept = torch.tensor(case["mask"], dtype=torch.float64)
    torch.testing.assert_close(response(mini_batch.loss_mask, 6), kept)
    torch.testing.assert_close(mini_batch.loss_weights, loss_weights(mini_batch.loss_mask, "token_mean"))
    advantages = response(mini_batch.advantages, 6)
    assert (advantages[kept == 0] == 0).all()
    metrics = learner.train_step(mini_batch, 0)
    original = torch.tensor(REJECTION["mask"]).sum()
    assert metrics["rejected_tokens"] == float(original - kept.sum()) and metrics["tokens"] == float(kept.sum())
    assert metrics["loss"] == pytest.approx(float(-(advantages * kept).sum() / kept.sum()), abs=1e-6)


def test_rules_chain_and_weights_are_taken_before_rejection(tiny_model_dir):
    """Several rules multiply their masks (verl's comma-separated rollout_rs); is weights (normalised over the
    mask before rejection, verl's order) are 0 on rejected tokens."""
    cases = {c["statistic"]: c for c in REJECTION["cases"]}
    rules = [{"statistic": "token_k2", "upper": 0.02}, {"statistic": "seq_max_k3", "upper": 0.1}]
    learner = learner_for(tiny_model_dir, off_policy="tis", rejection=rules, is_batch_normalize=True)
    (mini_batch,) = learner.prepare(with_log_ratio(learner, reference_samples(REJECTION["mask"]), REJECTION["log_ratio"]))
    kept = torch.tensor(cases["token_k2"]["mask"]) * torch.tensor(cases["seq_max_k3"]["mask"])
    assert 0 < kept.sum() < min(sum(map(sum, cases[s]["mask"])) for s in ("token_k2", "seq_max_k3"))
    torch.testing.assert_close(response(mini_batch.loss_mask, 6), kept.double())
    weights = response(mini_batch.is_weights, 6)
    assert (weights[kept == 0] == 0).all() and (weights[kept > 0] > 0).all()
    log_ratio = torch.tensor(REJECTION["log_ratio"], dtype=torch.float64)
    mask = torch.tensor(REJECTION["mask"], dtype=torch.float64)
    raw = log_ratio.exp().clamp(max=2.0)
    mean = (raw * mask).sum() / mask.sum()
    torch.testing.assert_close(weights, raw / mean * kept, rtol=0, atol=1e-5)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_rejection_normalisation_does_not_depend_on_the_split(tiny_model_dir, agg):
    """Kept-token counts are totalled per mini-batch before the loss: micro-batch sizes give the same step."""
    rules = [{"statistic": "token_k1", "upper": 1.3}, {"statistic": "seq_mean_k2", "upper": 0.02}]
    results = []
    for micro in (1, 2, 8):
        learner = learner_for(tiny_model_dir, micro, off_policy="tis", rejection=rules, loss_agg=agg)
        rng = np.random.default_rng(0)
        samples = make_samples()
        samples = with_log_ratio(learner, samples, [rng.normal(0, 0.3, s.response_ids.size) for s in samples])
        (mini_batch,) = learner.prepare(samples)
        metrics = learner.train_step(mini_batch, 0)
        results.append((metrics["loss"], metrics["grad_norm"], metrics["rejected_tokens"]))
    assert 0 < results[0][2] < sum(s.response_ids.size for s in make_samples())
    for other in results[1:]:
        np.testing.assert_allclose(other, results[0], rtol=0, atol=2e-6)


def test_seq_mean_token_sum_norm_keeps_its_constant_under_rejection(tiny_model_dir):
    """The Dr. GRPO constant (longest response of the mini-batch) is taken before rejection."""
    learner = learner_for(tiny_model_dir, off_policy="recompute", loss_agg="seq_mean_token_sum_norm",
                          rejection=[{"statistic": "token_k2", "upper": 0.02}])
    (mini_batch,) = learner.prepare(with_log_ratio(learner, reference_samples(REJECTION["mask"]), REJECTION["log_ratio"]))
    assert mini_batch.loss_weights.max() == pytest.approx(1 / 6)  # row 0 had 6 trained tokens before rejection


def current_logprobs(learner, samples) -> torch.Tensor:
    batch = collate(samples)
    with torch.no_grad():
        return run_policy(learner.policy, batch.input_ids, batch.attention_mask).logprobs


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bypass_reinforce_uses_verl_bypass_weights_of_the_current_policy(tiny_model_dir, level):
    """verl's bypass mode with loss_type reinforce: old = rollout logprobs, no recompute, loss
    -A * log p * min(pi / pi_rollout, cap) with the current policy's logprobs (here, on the first step, the
    policy's own), so the weights are verl's rollout_is weights of the reference inputs."""
    log_ratio = torch.tensor(WEIGHTS["proximal"]) - torch.tensor(WEIGHTS["behaviour"])
    learner = learner_for(tiny_model_dir, 8, off_policy="bypass", policy_loss="reinforce", is_level=level,
                          loss_agg="token_mean")
    samples = with_log_ratio(learner, reference_samples(WEIGHTS["mask"]), log_ratio.tolist())
    (mini_batch,) = learner.prepare(samples)
    assert mini_batch.is_weights is None
    torch.testing.assert_close(mini_batch.old_logprobs, mini_batch.rollout_logprobs)
    mini_batch.advantages = torch.zeros_like(mini_batch.loss_mask)
    mini_batch.advantages[:, PROMPT - 1 : PROMPT + 5] = ADVANTAGES.float()
    mini_batch.advantages *= mini_batch.loss_mask
    logprobs = response(current_logprobs(learner, samples), 6)
    expected_weights = torch.tensor(WEIGHTS["cases"][0 if level == "token" else 2]["weights"], dtype=torch.float64)
    mask = torch.tensor(WEIGHTS["mask"], dtype=torch.float64)
    expected = float((-ADVANTAGES * logprobs * expected_weights * mask).sum() / mask.sum())
    metrics = learner.train_step(mini_batch, 0)
    assert metrics["loss"] == pytest.approx(expected, abs=1e-5)
    assert metrics["is_weight"] == pytest.approx(float((expected_weights * mask).sum() / mask.sum()), abs=1e-5)


def test_bypass_ppo_is_the_uncorrected_ratio_and_rejects_on_the_current_policy(tiny_model_dir):
    """bypass + ppo: no weights (the ratio against the rollout is the correction), so without rejection it is
    off_policy none exactly; a rejection rule masks verl's tokens and counts them (normalisation unchanged)."""
    log_ratio = REJECTION["log_ratio"]
    losses = {}
    for name, algorithm in {"none": {}, "bypass": {"off_policy": "bypass"},
                            "bypass-rs": {"off_policy": "bypass", "rejection": [{"statistic": "token_k3", "upper": 0.03}]}}.items():
        learner = learner_for(tiny_model_dir, 8, loss_agg="token_mean", **algorithm)
        (mini_batch,) = learner.prepare(with_log_ratio(learner, reference_samples(REJECTION["mask"]), log_ratio))
        losses[name] = learner.train_step(mini_batch, 0)
    assert losses["bypass"]["loss"] == losses["none"]["loss"]
    case = next(c for c in REJECTION["cases"] if c["statistic"] == "token_k3")
    kept = torch.tensor(case["mask"])
    assert losses["bypass-rs"]["rejected_tokens"] == float(torch.tensor(REJECTION["mask"]).sum() - kept.sum())
    assert losses["bypass-rs"]["loss"] != losses["none"]["loss"]


def test_recompute_takes_the_ratio_against_the_proximal_policy_without_weights(tiny_model_dir):
    learner = learner_for(tiny_model_dir, off_policy="recompute")
    samples = with_log_ratio(learner, make_samples(), [np.full(s.response_ids.size, 0.5) for s in make_samples()])
    (mini_batch,) = learner.prepare(samples)
    assert mini_batch.is_weights is None
    torch.testing.assert_close(mini_batch.old_logprobs - mini_batch.rollout_logprobs, 0.5 * mini_batch.loss_mask,
                               rtol=0, atol=1e-5)
    assert learner.train_step(mini_batch, 0)["ratio"] == pytest.approx(1.0, abs=1e-5)


def test_off_policy_options_are_checked():
    rule = [{"statistic": "token_k1", "upper": 2.0}]
    with pytest.raises(ValueError, match="rejection: needs off_policy"):
        AlgorithmConfig(rejection=rule)
    with pytest.raises(ValueError, match="is_batch_normalize"):
        AlgorithmConfig(off_policy="bypass", is_batch_normalize=True)
    with pytest.raises(ValueError, match="lower applies to k1"):
        AlgorithmConfig(off_policy="tis", rejection=[{"statistic": "token_k2", "upper": 0.1, "lower": 0.01}])
    with pytest.raises(ValueError, match="lower must not exceed upper"):
        AlgorithmConfig(off_policy="tis", rejection=[{"statistic": "token_k1", "upper": 0.5}])
    with pytest.raises(ValueError, match="bypass: grpo and ppo only"):
        AlgorithmConfig(name="distill", off_policy="bypass")
