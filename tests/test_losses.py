"""Losses and advantages against values computed by hand on small tensors."""

import math

import pytest
import torch

from trainer.advantages import (
    discounted_returns,
    gae,
    grpo_advantages,
    kl_reward_penalty,
    masked_moments,
    rloo_advantages,
    terminal_rewards,
    whiten,
)
from trainer.corrections import (
    decoupled_weights,
    is_weight_moments,
    normalize_is_weights,
    rejection_mask,
    tis_weights,
)
from trainer.losses import (
    aggregate,
    distill_reverse_kl,
    dpo_loss,
    entropy_from_logits,
    kl_penalty,
    loss_weights,
    masked_mean,
    ppo_policy_loss,
    sft_loss,
    value_loss,
)


def close(actual, expected, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected).double(), rtol=0, atol=tol)


VALUES = torch.tensor([[1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 0.0, 0.0], [5.0, 5.0, 5.0, 5.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])


def test_masked_mean_ignores_masked_entries_and_empty_rows_give_zero():
    close(masked_mean(VALUES, MASK), 40 / 6)
    close(masked_mean(VALUES, MASK, dim=-1), [2.5, 15.0, 0.0])


@pytest.mark.parametrize(
    ("agg", "norm_length", "norm_seqs", "expected"),
    [
        ("token_mean", None, False, 40 / 6),  # (1+2+3+4+10+20) / 6 tokens
        ("seq_mean_token_sum", None, False, (10 + 30) / 2),  # the empty third row does not count
        ("seq_mean_token_mean", None, False, (2.5 + 15.0) / 2),
        ("seq_mean_token_sum_norm", None, False, (10 + 30) / 4),  # verl: not divided by the sequences; longest: 4
        ("seq_mean_token_sum_norm", 8, False, (10 + 30) / 8),
        ("seq_mean_token_sum_norm", 8, True, (10 / 8 + 30 / 8) / 2),  # the Dr. GRPO paper's 1/G
    ],
)
def test_aggregations(agg, norm_length, norm_seqs, expected):
    close(aggregate(VALUES, MASK, agg, norm_length, norm_seqs), expected)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_weights_of_the_whole_batch_make_row_splits_add_up(agg):
    weights = loss_weights(MASK, agg)
    parts = sum((VALUES[rows] * weights[rows]).sum() for rows in (slice(0, 1), slice(1, 3)))
    close(parts, aggregate(VALUES, MASK, agg))


def test_unknown_aggregation_is_an_error():
    with pytest.raises(ValueError, match="loss_agg"):
        loss_weights(MASK, "sum")


def test_sft_loss_is_negative_logprob():
    close(sft_loss(torch.tensor([-0.5, -2.0])), [0.5, 2.0])


def test_dpo_loss_by_hand():
    # margin = (-1 - -2) - (-3 - -2) = 2; beta 0.5 -> -log sigmoid(1) = log(1 + e^-1)
    pair = torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0])
    close(dpo_loss(*pair, beta=0.5), [math.log(1 + math.exp(-1))])
    close(dpo_loss(*pair, beta=0.25, loss_type="hinge"), [0.5])  # relu(1 - 0.25 * 2)
    # ipo: log-ratios per token, 1/2 and -1/4: ((0.5 + 0.25) - 1 / (2 * 0.5))^2
    ipo = dpo_loss(*pair, beta=0.5, loss_type="ipo", chosen_tokens=torch.tensor([2.0]), rejected_tokens=torch.tensor([4.0]))
    close(ipo, [0.25**2])
    with pytest.raises(ValueError, match="number of response tokens"):
        dpo_loss(*pair, beta=0.5, loss_type="ipo")
    # Policy equal to the reference: log 2 whatever the logprobs.
    same = dpo_loss(torch.tensor([-4.0]), torch.tensor([-7.0]), torch.tensor([-4.0]), torch.tensor([-7.0]), beta=0.1)
    close(same, [math.log(2)])


def test_ppo_clipped_surrogate_with_asymmetric_range():
    ratios = torch.tensor([1.5, 0.5, 1.1, 0.7, 1.25])
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0])
    old = torch.full((5,), -2.0)
    loss, clipped, dual = ppo_policy_loss(old + ratios.log(), old, advantages, clip_eps_low=0.2, clip_eps_high=0.28)
    # 1.5*A+ clipped to 1.28; 0.5*A+ unclipped (min); 1.1*A- inside; 0.7*A- clipped to 0.8; 1.25 inside [0.8, 1.28].
    close(loss, [-1.28, -0.5, 1.1, 0.8, -1.25], tol=1e-5)
    close(clipped, [1.0, 0.0, 0.0, 1.0, 0.0])
    close(dual, [0.0] * 5)
    symmetric, _, _ = ppo_policy_loss(old + ratios.log(), old, advantages, clip_eps_low=0.2, clip_eps_high=0.2)
    close(symmetric[-1], -1.2, tol=1e-5)


def test_ppo_dual_clip_bounds_the_loss_of_negative_advantages():
    ratios = torch.tensor([5.0, 5.0, 2.0])
    advantages = torch.tensor([-1.0, 1.0, -1.0])
    logprobs = ratios.log().requires_grad_(True)
    loss, _, dual = ppo_policy_loss(logprobs, torch.zeros(3), advantages, 0.2, 0.2, clip_ratio_c=3.0)
    # A < 0 with ratio 5: the surrogate 5 is capped at -A * 3 = 3; A > 0 is never dual-clipped (clipped to 1.2).
    close(loss, [3.0, -1.2, 2.0], tol=1e-5)
    close(dual, [1.0, 0.0, 0.0])
    loss.sum().backward()
    close(logprobs.grad, [0.0, 0.0, 2.0], tol=1e-5)  # no gradient through a dual-clipped token
    off, _, _ = ppo_policy_loss(ratios.log(), torch.zeros(3), advantages, 0.2, 0.2, clip_ratio_c=None)
    close(off, [5.0, -1.2, 2.0], tol=1e-5)


def test_ppo_log_ratio_is_clamped_so_an_outlier_token_stays_finite():
    loss, _, _ = ppo_policy_loss(torch.tensor([100.0]), torch.tensor([0.0]), torch.tensor([-1.0]), 0.2, 0.2, None)
    close(loss, [math.exp(20.0)], tol=1e-6 * math.exp(20.0))


def test_ppo_gradient_vanishes_outside_the_clip_range():
    logprobs = torch.tensor([math.log(1.5), math.log(1.1)], requires_grad=True)
    loss, _, _ = ppo_policy_loss(logprobs, torch.zeros(2), torch.ones(2), 0.2, 0.2)
    loss.sum().backward()
    close(logprobs.grad, [0.0, -1.1], tol=1e-6)  # d(-r*A)/d logp = -r*A inside the range


def test_value_loss_clipped_by_hand():
    values = torch.tensor([1.5, 0.9])
    old = torch.tensor([1.0, 1.0])
    returns = torch.tensor([2.0, 0.0])
    # v=1.5: max((1.5-2)^2, (1.2-2)^2) = 0.64; v=0.9 (inside the clip): 0.81
    close(value_loss(values, old, returns, clip_eps=0.2), [0.32, 0.405])


def test_kl_estimators_by_hand():
    logprobs, ref = torch.tensor([math.log(0.5), -1.0]), torch.tensor([math.log(0.25), -1.0])
    close(kl_penalty(logprobs, ref, "k1"), [math.log(2), 0.0])
    close(kl_penalty(logprobs, ref, "abs"), [math.log(2), 0.0])
    close(kl_penalty(ref, logprobs, "abs"), [math.log(2), 0.0])
    close(kl_penalty(logprobs, ref, "k2"), [0.5 * math.log(2) ** 2, 0.0])
    close(kl_penalty(logprobs, ref, "k3"), [0.5 - math.log(0.5) - 1, 0.0])
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logprobs, ref, "k4")


def test_k3_is_clamped_and_has_no_gradient_beyond_the_clamp():
    # log q/p = 25: unclamped k3 would be e^25 - 26 ~ 7e10; verl clamps log q/p to 20 and k3 to 10.
    logprobs = torch.tensor([-30.0, -30.0, -2.0], requires_grad=True)
    kl = kl_penalty(logprobs, torch.tensor([-5.0, -55.0, -5.0]), "k3")
    # log q/p = 25, -25 (e^-20 + 20 - 1 = 19 before the cap), -3 (inside both clamps).
    close(kl, [10.0, 10.0, math.exp(-3) + 3 - 1], tol=1e-5)
    kl.sum().backward()
    close(logprobs.grad, [0.0, 0.0, 1 - math.exp(-3)], tol=1e-6)


def test_entropy_from_logits():
    close(entropy_from_logits(torch.zeros(1, 4)), [math.log(4)])
    close(entropy_from_logits(torch.tensor([[0.0, math.log(3.0)]])), [-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])


def test_distill_reverse_kl_value_and_gradient():
    logprobs = torch.tensor([math.log(0.5), math.log(0.2)], requires_grad=True)
    teacher = torch.tensor([math.log(0.25), math.log(0.4)])
    loss, reverse_kl = distill_reverse_kl(logprobs, logprobs.detach(), teacher)
    close(reverse_kl, [math.log(2), math.log(0.5)])
    loss.sum().backward()
    # The per-token score-function gradient: (log p - log q) * d log p.
    close(logprobs.grad, [math.log(2), math.log(0.5)])


def test_off_policy_weights_truncate_or_drop():
    proximal = torch.log(torch.tensor([0.6, 0.2, 0.3]))
    behaviour = torch.log(torch.tensor([0.2, 0.4, 0.3]))
    close(tis_weights(proximal, behaviour, cap=2.0), [2.0, 0.5, 1.0])  # 3 truncated at the cap
    close(decoupled_weights(proximal, behaviour, cap=2.0), [0.0, 0.5, 1.0])  # 3 above the cap: dropped


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    advantages = grpo_advantages(rewards, torch.zeros(4, dtype=torch.int64))
    # mean 0.5, unbiased std sqrt(1/3)
    close(advantages, [0.5 / math.sqrt(1 / 3)] + [-0.5 / math.sqrt(1 / 3)] * 2 + [0.5 / math.sqrt(1 / 3)], tol=1e-5)


def test_grpo_edge_cases_all_equal_give_zero_and_a_group_of_one_its_score():
    rewards = torch.tensor([1.0, 2.0, 0.1, 0.1, 0.1, 7.0])
    groups = torch.tensor([0, 0, 1, 1, 1, 2])
    advantages = grpo_advantages(rewards, groups)
    assert not torch.isnan(advantages).any()
    # verl: a group of one has mean 0 and std 1, so its advantage is 7 / (1 + eps).
    close(advantages, [-0.5 / math.sqrt(0.5), 0.5 / math.sqrt(0.5), 0, 0, 0, 7.0 / (1 + 1e-6)], tol=1e-5)
    assert (advantages[2:5] == 0).all()  # exactly, not approximately
    dr_grpo = grpo_advantages(rewards, groups, norm_std=False)
    close(dr_grpo, [-0.5, 0.5, 0, 0, 0, 7.0])
    assert (dr_grpo[2:5] == 0).all()
    zero = grpo_advantages(rewards, groups, group_of_one="zero")
    assert (zero[2:] == 0).all()
    close(zero[:2], advantages[:2])


def test_terminal_rewards_sit_on_the_last_trained_token():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    close(terminal_rewards(torch.tensor([1.0, 2.0, 3.0]), mask), [[0, 1, 0], [0, 0, 2], [0, 0, 0]])


def test_gae_by_hand_steps_over_masked_tokens():
    values = torch.tensor([[0.5, 0.2, 9.0, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    advantages, returns = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    a3 = 1.0 - 0.1  # delta at the last step (next value 0)
    a1 = (0.9 * 0.1 - 0.2) + 0.9 * 0.8 * a3  # the masked token is skipped
    a0 = (0.9 * 0.2 - 0.5) + 0.9 * 0.8 * a1
    close(advantages, [[a0, a1, 0.0, a3]])
    close(returns, [[a0 + 0.5, a1 + 0.2, 0.0, a3 + 0.1]])


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    values = torch.tensor([[0.3, -0.2, 0.7]])
    mask = torch.ones(1, 3)
    advantages, _ = gae(terminal_rewards(torch.tensor([2.0]), mask), values, mask, gamma=1.0, lam=1.0)
    close(advantages, 2.0 - values)


def test_whiten_over_masked_entries_and_moments_add_across_parts():
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    whitened = whiten(values, mask, masked_moments(values, mask))
    close(whitened, [[-1.0, 0.0, 1.0, 0.0]], tol=1e-5)  # unbiased variance (verl): ((1 + 0 + 1) / 2) = 1
    biased = whiten(values, mask, masked_moments(values, mask), unbiased=False)
    close(biased, [[-1 / math.sqrt(2 / 3), 0.0, 1 / math.sqrt(2 / 3), 0.0]], tol=1e-5)
    close(whiten(values, torch.tensor([[0.0, 1.0, 0.0, 0.0]]), masked_moments(values, torch.tensor([[0.0, 1.0, 0.0, 0.0]]))), [[0.0] * 4])
    split = masked_moments(values[:, :2], mask[:, :2]) + masked_moments(values[:, 2:], mask[:, 2:])
    close(split, masked_moments(values, mask))


def test_rloo_leaves_each_sample_out_of_its_baseline():
    rewards, groups = torch.tensor([1.0, 0.0, 0.0, 5.0]), torch.tensor([0, 0, 0, 1])
    close(rloo_advantages(rewards, groups), [1.0, -0.5, -0.5, 5.0])  # 1 - mean(0, 0); 0 - mean(1, 0); group of one
    close(rloo_advantages(rewards, groups, group_of_one="zero"), [1.0, -0.5, -0.5, 0.0])


def test_discounted_returns_restart_at_masked_tokens_unless_told_to_step_over_them():
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])  # an environment token at column 1
    close(discounted_returns(rewards, mask, 0.5), [[0.0, 0.0, 0.5, 1.0]])  # verl: the return does not cross it
    close(discounted_returns(rewards, mask, 0.5, steps_over_masked=True), [[0.25, 0.0, 0.5, 1.0]])


def test_kl_reward_penalty_subtracts_on_trained_tokens_only():
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    penalised = kl_reward_penalty(rewards, torch.tensor([[-1.0, -1.0, -1.0]]), torch.tensor([[-2.0, -1.5, -3.0]]),
                                  torch.tensor([[1.0, 1.0, 0.0]]), coef=0.1)  # fmt: skip
    close(penalised, [[-0.1, 0.95, 0.0]])


def test_batch_normalised_weights_average_one_over_tokens_or_sequences():
    weights = torch.tensor([[2.0, 1.0, 0.0], [0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(normalize_is_weights(weights, is_weight_moments(weights, mask, "token")), weights / (3.5 / 3))
    close(normalize_is_weights(weights, is_weight_moments(weights, mask, "sequence")), weights / ((1.5 + 0.5) / 2))


def test_rejection_masks_drop_tokens_or_whole_sequences():
    log_ratio = torch.tensor([[0.0, 1.0, 0.1], [0.2, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    close(rejection_mask(log_ratio, mask, "token_k2", upper=0.1), [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    close(rejection_mask(log_ratio, mask, "seq_max_k2", upper=0.1), [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    # k1 = -log_ratio kept in [log(1/2), log 2]: log_ratio 1 > log 2 is rejected.
    close(rejection_mask(log_ratio, mask, "token_k1", upper=2.0), [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="rejection"):
        rejection_mask(log_ratio, mask, "seq_max_k1", upper=2.0)
