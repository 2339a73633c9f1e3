"""Advantage estimators: GRPO group normalisation, GAE for PPO, masked whitening, KL in the reward.

Each follows verl's `trainer/ppo/core_algos.py`; tests/test_reference_verl.py checks them against it.
"""

from typing import Literal

import torch

from trainer.losses import KLEstimator, kl_penalty

GroupOfOne = Literal["score", "zero"]


def grpo_advantages(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    norm_std: bool = True,
    eps: float = 1e-6,
    group_of_one: GroupOfOne = "score",
) -> torch.Tensor:
    """Sequence advantages (r - mean_group) / (std_group + eps); `norm_std=False` skips the std (Dr. GRPO).

    `group_index[i]` is the group (prompt) of sample i, in [0, num_groups). The std is the
    unbiased one. A group whose rewards are all equal gets advantage exactly 0 (verl: 0 up to
    rounding). A group of one: `score` (verl) takes mean 0 and std 1, so its advantage is
    r / (1 + eps) (r without the std); `zero` gives it 0, as a group with no baseline to compare to.
    """
    rewards64 = rewards.double()
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(rewards64))
    means = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, rewards64) / counts
    single = (counts == 1)[group_index]
    centered = rewards64 - torch.where(single, torch.zeros_like(rewards64), means[group_index])
    if norm_std:
        squares = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, centered**2)
        stds = torch.where(counts == 1, torch.ones_like(counts), (squares / (counts - 1).clamp(min=1)).sqrt())
        centered = centered / (stds[group_index] + eps)
    highest = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, group_index, rewards64, "amax")
    lowest = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, group_index, rewards64, "amin")
    zero = (highest == lowest)[group_index] & ~single
    if group_of_one == "zero":
        zero = zero | single
    elif group_of_one != "score":
        raise ValueError(f"grpo_group_of_one: unknown rule {group_of_one!r}")
    return torch.where(zero, torch.zeros_like(centered), centered).to(rewards.dtype)


def rloo_advantages(rewards: torch.Tensor, group_index: torch.Tensor, group_of_one: GroupOfOne = "score") -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): each reward minus the mean of the other rewards of its group,
    (r - mean) * n / (n - 1), as verl's `compute_rloo_outcome_advantage`. A group of one: `score` keeps
    its reward (verl's rloo), `zero` gives 0 (verl's rloo_vectorized)."""
    rewards64 = rewards.double()
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(rewards64))
    means = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, rewards64) / counts
    n = counts[group_index]
    loo = (rewards64 - means[group_index]) * n / (n - 1).clamp(min=1)
    if group_of_one not in ("score", "zero"):
        raise ValueError(f"group_of_one: unknown rule {group_of_one!r}")
    single = torch.zeros_like(rewards64) if group_of_one == "zero" else rewards64
    return torch.where(n == 1, single, loo).to(rewards.dtype)


def discounted_returns(
    token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float, steps_over_masked: bool = False
) -> torch.Tensor:
    """Per-token discounted returns (REINFORCE++, Hu 2025), as verl's `compute_reinforce_plus_plus_outcome_advantage`
    before its whitening (whiten these with `masked_moments` / `whiten` for its advantages).

    As verl, the running return restarts at a masked-out token: tokens before a masked span (environment
    tokens of a multi-turn sample) do not see rewards after it. `steps_over_masked=True` steps over masked
    tokens instead, as `gae` does. Masked-out tokens get return 0 (verl: their reward plus the discounted
    return after them; no loss reads them).
    """
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[-1])):
        is_step = mask[:, t] > 0
        step_return = token_rewards[:, t] + gamma * running
        returns[:, t] = torch.where(is_step, step_return, torch.zeros_like(step_return))
        running = torch.where(is_step, step_return, running if steps_over_masked else torch.zeros_like(running))
    return returns


def terminal_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token rewards [batch, tokens]: each sequence's scalar reward on its last trained token."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask > 0, positions, -1).max(-1).values
    token_rewards = torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)
    has_tokens = last >= 0
    token_rewards[has_tokens, last[has_tokens]] = rewards[has_tokens]
    return token_rewards


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the trained tokens of each sequence.

    Masked-out tokens (environment observations, padding) are not time steps: the recursion
    steps over them, and they get advantage and return 0. The value after the last trained
    token is 0 (the episode ends). Returns (advantages, returns), returns = advantages + values.
    """
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[-1])):
        is_step = mask[:, t] > 0
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(is_step, advantage, torch.zeros_like(advantage))
        next_advantage = torch.where(is_step, advantage, next_advantage)
        next_value = torch.where(is_step, values[:, t], next_value)
    returns = (advantages + values) * mask
    return advantages, returns


def masked_moments(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, count] of the masked entries (float64), summable across ranks."""
    values64, mask64 = values.double(), mask.double()
    return torch.stack([(values64 * mask64).sum(), (values64**2 * mask64).sum(), mask64.sum()])


def whiten(
    values: torch.Tensor, mask: torch.Tensor, moments: torch.Tensor, eps: float = 1e-8, unbiased: bool = True
) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over masked entries, from `masked_moments` (possibly summed over ranks).

    The variance is the unbiased one (N - 1), as verl's masked_whiten; `unbiased=False` divides by N.
    Masked-out entries come back 0 (verl leaves them whitened; no loss reads them). A single entry
    whitens to 0 (verl raises).
    """
    total, total_sq, count = moments.unbind()
    count = count.clamp(min=1)
    mean = total / count
    var = (total_sq / count - mean**2).clamp(min=0)
    if unbiased:
        var = var * count / (count - 1).clamp(min=1)
    return (((values.double() - mean) * torch.rsqrt(var + eps)) * mask).to(values.dtype)


def kl_reward_penalty(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: KLEstimator = "k1",
) -> torch.Tensor:
    """KL to the reference as a reward penalty (verl's use_kl_in_reward / apply_kl_penalty):
    token rewards minus coef * KL estimate on every trained token, before advantages are estimated.

    `logprobs` are the policy's before the update (verl: old_log_probs); verl's default estimator is k1.
    """
    return token_rewards - coef * kl_penalty(logprobs, ref_logprobs, estimator) * mask


SequenceEstimator = Literal["grpo", "rloo", "reinforce_plus_plus_baseline"]


def sequence_advantages(
    estimator: SequenceEstimator,
    scores: torch.Tensor,
    group_index: torch.Tensor,
    norm_std: bool = True,
    eps: float = 1e-6,
    group_of_one: GroupOfOne = "score",
) -> torch.Tensor:
    """One advantage per sequence from its score (reward, minus its KL sum when KL is in the reward):
    grpo (`grpo_advantages`), rloo (`rloo_advantages`), or reinforce_plus_plus_baseline's group-centred score
    (verl's compute_reinforce_plus_plus_baseline_outcome_advantage before it whitens them over the batch)."""
    if estimator == "grpo":
        return grpo_advantages(scores, group_index, norm_std, eps, group_of_one)
    if estimator == "rloo":
        return rloo_advantages(scores, group_index, group_of_one)
    if estimator == "reinforce_plus_plus_baseline":
        return grpo_advantages(scores, group_index, norm_std=False, group_of_one=group_of_one)
    raise ValueError(f"advantage_estimator: {estimator!r} is not a sequence-level estimator")


def varied_groups(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: True for each sample of a group whose rewards are not all equal, or of a group of
    one (verl's DAPO keeps those: its filter drops groups of zero std with more than one member)."""
    num_groups = int(group_index.max()) + 1 if group_index.numel() else 0
    rewards64 = rewards.double()
    highest = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, group_index, rewards64, "amax")
    lowest = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, group_index, rewards64, "amin")
    counts = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, group_index, torch.ones_like(rewards64))
    return ((highest > lowest) | (counts == 1))[group_index]
