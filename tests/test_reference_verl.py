"""Losses, advantages and off-policy corrections against numbers computed by verl's own code.

Reference: volcengine/verl at commit b178a3cd56f58b2d502255daba591e92833930a7 (2026-01-29):
verl/trainer/ppo/core_algos.py, verl/trainer/ppo/rollout_corr_helper.py, verl/utils/torch_functional.py
and verl/trainer/ppo/ray_trainer.py (apply_kl_penalty). tests/data/reference/generate.py ran those
functions on the inputs stored with the expected outputs in tests/data/reference/verl.json. The inputs
exercise every branch: a fully masked row, a single-token row, a row with masked (environment) tokens
in the middle, tokens inside, below and above the clip range, dual-clipped tokens, log-ratios beyond
the +-20 clamp, groups with equal rewards and groups of one. Agreement in float64 to 1e-6.
"""

import json
import pathlib

import pytest
import torch

from trainer.advantages import (
    discounted_returns,
    gae,
    grpo_advantages,
    kl_reward_penalty,
    masked_moments,
    rloo_advantages,
    whiten,
)
from trainer.corrections import is_weight_moments, normalize_is_weights, rejection_mask, tis_weights
from trainer.losses import (
    aggregate,
    cispo_policy_loss,
    gspo_policy_loss,
    kl_penalty,
    loss_weights,
    ppo_policy_loss,
    reinforce_loss,
    sapo_policy_loss,
    value_loss,
)

COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
DATA = json.loads((pathlib.Path(__file__).parent / "data" / "reference" / "verl.json").read_text())
AGG = {  # verl's loss_agg_mode -> ours
    "token-mean": "token_mean",
    "seq-mean-token-sum": "seq_mean_token_sum",
    "seq-mean-token-mean": "seq_mean_token_mean",
    "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
}


def f64(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64)


def close(actual, expected) -> None:
    """Within 1e-6 absolute, or 1e-7 relative for large values: verl adds 1e-8 to the token counts it
    divides by (masked_mean, seq-mean-token-mean), ~1e-8 relative, which matters only for values such as
    GSPO's loss of ~570 here (sequence ratios up to e^8) or ratios near e^20 (a clamped log-ratio)."""
    torch.testing.assert_close(f64(actual).detach(), f64(expected), rtol=1e-7, atol=1e-6)


INPUTS = {name: f64(value) for name, value in DATA["inputs"].items()}
MASK, WIDTH = INPUTS["mask"], INPUTS["mask"].shape[-1]


def test_the_data_comes_from_the_named_revision():
    assert DATA["reference"] == {"repo": "volcengine/verl", "commit": COMMIT}
    rows = MASK.sum(-1).tolist()
    assert 0.0 in rows and 1.0 in rows  # a fully masked row, a single-token row


@pytest.mark.parametrize("case", DATA["policy_loss_vanilla"], ids=lambda c: "-".join(map(str, c["params"].values())))
def test_ppo_policy_loss_equals_compute_policy_loss_vanilla(case):
    """core_algos.compute_policy_loss_vanilla: per-token loss, every aggregation, gradients, clip fractions."""
    p = case["params"]
    args = INPUTS["old_logprobs"], INPUTS["advantages"], p["clip_eps_low"], p["clip_eps_high"], p["clip_ratio_c"]
    loss, clipped, dual = ppo_policy_loss(INPUTS["logprobs"], *args)
    close(loss * MASK, case["per_token"])
    close(aggregate(clipped, MASK, "token_mean"), case["clipfrac"])
    close(aggregate(dual, MASK, "token_mean"), case["clipfrac_lower"])
    assert case["clipfrac"] > 0 and case["clipfrac_lower"] > 0  # both branches are exercised
    for mode, expected in case["aggregated"].items():
        logprobs = INPUTS["logprobs"].clone().requires_grad_(True)
        # verl's seq-mean-token-sum-norm divides by the padded width; ours by norm_length.
        total = aggregate(ppo_policy_loss(logprobs, *args)[0], MASK, AGG[mode], norm_length=WIDTH)
        total.backward()
        close(total, expected)
        close(logprobs.grad, case["grad"][mode])


@pytest.mark.parametrize("case", DATA["policy_loss_gspo"], ids=lambda c: str(c["params"]["clip_eps_low"]))
def test_gspo_policy_loss_equals_compute_policy_loss_gspo(case):
    """core_algos.compute_policy_loss_gspo (which aggregates by seq-mean-token-mean): loss, gradient, clip fraction."""
    logprobs = INPUTS["logprobs"].clone().requires_grad_(True)
    p = case["params"]
    losses, clipped = gspo_policy_loss(
        logprobs, INPUTS["old_logprobs"], INPUTS["advantages"], MASK, p["clip_eps_low"], p["clip_eps_high"]
    )
    total = aggregate(losses, MASK, "seq_mean_token_mean")
    total.backward()
    close(total, case["loss"])
    close(logprobs.grad, case["grad"])
    close(aggregate(clipped, MASK, "token_mean"), case["clipfrac"])


@pytest.mark.parametrize("case", DATA["policy_loss_cispo"], ids=lambda c: str(c["params"]["clip_eps_high"]))
@pytest.mark.parametrize("mode", list(AGG))
def test_cispo_policy_loss_equals_compute_policy_loss_cispo(case, mode):
    """core_algos.compute_policy_loss_cispo: every aggregation, gradient (through log p only), clip fraction."""
    logprobs = INPUTS["logprobs"].clone().requires_grad_(True)
    p = case["params"]
    losses, clipped = cispo_policy_loss(
        logprobs, INPUTS["old_logprobs"], INPUTS["advantages"], p["clip_eps_low"], p["clip_eps_high"]
    )
    total = aggregate(losses, MASK, AGG[mode], norm_length=WIDTH)
    total.backward()
    close(total, case["aggregated"][mode])
    close(logprobs.grad, case["grad"][mode])
    close(aggregate(clipped, MASK, "token_mean"), case["clipfrac"])


@pytest.mark.parametrize("case", DATA["policy_loss_sapo"], ids=lambda c: f"{c['params']['tau_pos']}-{c['params']['tau_neg']}")
def test_sapo_policy_loss_equals_compute_policy_loss_sapo(case):
    """core_algos.compute_policy_loss_sapo (which aggregates by seq-mean-token-mean): loss and gradient."""
    logprobs = INPUTS["logprobs"].clone().requires_grad_(True)
    losses = sapo_policy_loss(logprobs, INPUTS["old_logprobs"], INPUTS["advantages"], **case["params"])
    total = aggregate(losses, MASK, "seq_mean_token_mean")
    total.backward()
    close(total, case["loss"])
    close(logprobs.grad, case["grad"])


@pytest.mark.parametrize("case", DATA["policy_loss_reinforce"], ids=lambda c: f"{c['mode']}-w{c['is_weights'] is not None}")
def test_reinforce_loss_equals_compute_policy_loss_reinforce(case):
    """core_algos.compute_policy_loss_reinforce, plain and with bypass-mode weights (token TIS of the current
    policy against the rollout's, rollout_corr_helper.compute_rollout_correction_weights); ours computes
    those weights with tis_weights from the detached logprobs."""
    logprobs = INPUTS["logprobs"].clone().requires_grad_(True)
    losses = reinforce_loss(logprobs, INPUTS["advantages"])
    if case["is_weights"] is not None:
        weights = tis_weights(logprobs.detach(), INPUTS["old_logprobs"], 2.0, MASK)
        close(weights, case["is_weights"])
        losses = losses * weights
    total = aggregate(losses, MASK, AGG[case["mode"]])
    total.backward()
    close(total, case["loss"])
    close(logprobs.grad, case["grad"])


def test_aggregation_equals_agg_loss():
    """core_algos.agg_loss on one micro-batch (dp 1): seq-mean-token-sum-norm is the token sum over a constant."""
    values, expected = f64(DATA["agg_loss"]["values"]), DATA["agg_loss"]["expected"]
    for mode, ours in AGG.items():
        close(aggregate(values, MASK, ours, norm_length=WIDTH if mode == "seq-mean-token-sum-norm" else None), expected[mode])
    close(aggregate(values, MASK, "seq_mean_token_sum_norm", norm_length=8), expected["seq-mean-token-sum-norm/scale=8"])
    # Our default constant, the longest response, is the padded width here (the first row is full).
    close(aggregate(values, MASK, "seq_mean_token_sum_norm"), expected["seq-mean-token-sum-norm"])
    close((values * loss_weights(MASK, "seq_mean_token_sum_norm", WIDTH)).sum(), expected["seq-mean-token-sum-norm"])


def test_grpo_advantages_equal_compute_grpo_outcome_advantage():
    """core_algos.compute_grpo_outcome_advantage: equal rewards give 0; a group of one gets its score over std 1."""
    (data,) = DATA["grpo_outcome_advantage"]
    rewards, groups, mask = f64(data["rewards"]), torch.tensor(data["group_index"]), f64(data["mask"])
    for case in data["cases"]:
        advantages = grpo_advantages(rewards, groups, norm_std=case["norm_std"], eps=1e-6)
        close(advantages[:, None] * mask, case["advantages"])


def test_rloo_and_reinforce_pp_baseline_equal_verl():
    """core_algos.compute_rloo_outcome_advantage (a group of one keeps its score) and
    compute_reinforce_plus_plus_baseline_outcome_advantage (group mean subtracted, then whitened over the batch)."""
    (data,) = DATA["grpo_outcome_advantage"]
    rewards, groups, mask = f64(data["rewards"]), torch.tensor(data["group_index"]), f64(data["mask"])
    close(rloo_advantages(rewards, groups)[:, None] * mask, data["rloo"])
    centred = grpo_advantages(rewards, groups, norm_std=False)[:, None] * mask
    close(whiten(centred, mask, masked_moments(centred, mask)), data["reinforce_plus_plus_baseline"])


@pytest.mark.parametrize("case", DATA["gae_advantage_return"][0]["cases"], ids=lambda c: f"{c['gamma']}-{c['lam']}")
def test_gae_and_whitening_equal_compute_gae_advantage_return(case):
    """core_algos.compute_gae_advantage_return (GAE, then masked_whiten with the unbiased variance).

    Compared on trained tokens: verl carries the running advantage over masked tokens and whitens them too;
    ours gives masked tokens 0, and no loss reads them."""
    data = DATA["gae_advantage_return"][0]
    rewards, values, mask = f64(data["token_rewards"]), f64(data["values"]), f64(data["mask"])
    advantages, returns = gae(rewards, values, mask, case["gamma"], case["lam"])
    whitened = whiten(advantages, mask, masked_moments(advantages, mask))
    close(whitened * mask, f64(case["advantages"]) * mask)
    close(returns * mask, f64(case["returns"]) * mask)


@pytest.mark.parametrize("case", DATA["gae_advantage_return"][0]["cases"], ids=lambda c: str(c["gamma"]))
def test_reinforce_pp_equals_compute_reinforce_plus_plus_outcome_advantage(case):
    """core_algos.compute_reinforce_plus_plus_outcome_advantage: discounted returns restarting at masked tokens
    (the last row has a masked span), whitened over the batch. Compared on trained tokens."""
    data = DATA["gae_advantage_return"][0]
    rewards, mask = f64(data["token_rewards"]), f64(data["mask"])
    returns = discounted_returns(rewards, mask, case["gamma"])
    close(returns, f64(case["reinforce_plus_plus_returns"]) * mask)
    close(whiten(returns, mask, masked_moments(returns, mask)), case["reinforce_plus_plus_advantages"])


def test_value_loss_equals_compute_value_loss():
    """core_algos.compute_value_loss: per token (one-hot masks) and token-mean."""
    data = DATA["value_loss"]
    losses = value_loss(f64(data["vpreds"]), f64(data["old_values"]), f64(data["returns"]), data["clip_eps"])
    close(losses * MASK, data["per_token"])
    close(aggregate(losses, MASK, "token_mean"), data["token_mean"])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_kl_estimators_equal_kl_penalty(estimator):
    """core_algos.kl_penalty: values and gradients, including log-ratios past k3's clamps."""
    data = DATA["kl_penalty"]
    logprobs = f64(data["logprobs"]).requires_grad_(True)
    kl = kl_penalty(logprobs, f64(data["ref_logprobs"]), estimator)
    kl.sum().backward()
    close(kl, data["expected"][estimator]["kl"])
    close(logprobs.grad, data["expected"][estimator]["grad"])


@pytest.mark.parametrize("case", DATA["apply_kl_penalty"][0]["cases"], ids=lambda c: c["estimator"])
def test_kl_reward_penalty_equals_apply_kl_penalty(case):
    """ray_trainer.apply_kl_penalty (use_kl_in_reward, fixed coefficient)."""
    data = DATA["apply_kl_penalty"][0]
    rewards = kl_reward_penalty(
        f64(data["scores"]), f64(data["logprobs"]), f64(data["ref_logprobs"]), f64(data["mask"]), case["coef"],
        case["estimator"],
    )
    close(rewards, case["token_rewards"])


@pytest.mark.parametrize(
    "case", DATA["rollout_correction_weights"][0]["cases"], ids=lambda c: f"{c['level']}-norm{c['normalize']}"
)
def test_importance_weights_equal_compute_rollout_correction_weights(case):
    """rollout_corr_helper.compute_rollout_correction_weights: token and sequence TIS, with batch normalisation."""
    data = DATA["rollout_correction_weights"][0]
    mask = f64(data["mask"])
    weights = tis_weights(f64(data["proximal"]), f64(data["behaviour"]), case["cap"], mask, case["level"])
    if case["normalize"]:
        weights = normalize_is_weights(weights, is_weight_moments(weights, mask, case["level"]))
    close(weights, case["weights"])


@pytest.mark.parametrize("case", DATA["rollout_rejection_mask"][0]["cases"], ids=lambda c: f"{c['statistic']}-{c['threshold']}")
def test_rejection_masks_equal_compute_rollout_rejection_mask(case):
    """rollout_corr_helper.compute_rollout_rejection_mask, one option at a time."""
    data = DATA["rollout_rejection_mask"][0]
    mask = f64(data["mask"])
    kept = rejection_mask(f64(data["log_ratio"]), mask, case["statistic"], case["upper"], case["lower"])
    close(kept, case["mask"])
    assert 0 < sum(map(sum, case["mask"])) < mask.sum()  # some tokens kept, some rejected
