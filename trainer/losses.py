"""Per-token losses and their aggregation: pure tensor functions, each written once.

Per-token tensors have shape [batch, tokens] and come with a float `mask` of the same shape
(1 = a trained-on response token). Losses return per-token values; `aggregate` turns them into
one scalar. Aggregation is expressed as per-token weights (`loss_weights`) so that a loss split
over micro-batches and data-parallel ranks sums back to exactly the full-batch loss.
"""

from typing import Literal

import torch
import torch.nn.functional as F

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k3"]


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked entries; 0 where nothing is masked in (never NaN)."""
    return masked_sum(values, mask, dim) / mask.sum(dim).clamp(min=1)


def loss_weights(mask: torch.Tensor, agg: LossAgg, norm_length: float | None = None) -> torch.Tensor:
    """Per-token weights w with `aggregate(x) == (x * w).sum()` for the whole batch.

    - token_mean: every trained token counts the same (DAPO's token-level loss);
    - seq_mean_token_mean: mean over each sequence's tokens, then over sequences (GRPO);
    - seq_mean_token_sum_norm: each sequence's token sum divided by a constant `norm_length`
      (default: the longest response in the batch), then mean over sequences (Dr. GRPO).
    Sequences with no trained token get weight 0 and do not count in the sequence mean.
    """
    mask = mask.float()
    tokens_per_seq = mask.sum(-1, keepdim=True)
    if agg == "token_mean":
        return mask / tokens_per_seq.sum().clamp(min=1)
    num_seqs = (tokens_per_seq > 0).sum().clamp(min=1)
    if agg == "seq_mean_token_mean":
        return mask / tokens_per_seq.clamp(min=1) / num_seqs
    if agg == "seq_mean_token_sum_norm":
        length = norm_length if norm_length is not None else tokens_per_seq.max().clamp(min=1)
        return mask / length / num_seqs
    raise ValueError(f"loss_agg: unknown aggregation {agg!r}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, agg: LossAgg, norm_length: float | None = None) -> torch.Tensor:
    """One scalar from per-token values (see `loss_weights`)."""
    return (values * loss_weights(mask, agg, norm_length)).sum()


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood of the response tokens."""
    return -logprobs


def dpo_loss(
    chosen_logprobs: torch.Tensor,
    rejected_logprobs: torch.Tensor,
    ref_chosen_logprobs: torch.Tensor,
    ref_rejected_logprobs: torch.Tensor,
    beta: float,
) -> torch.Tensor:
    """Per-pair sigmoid DPO loss from sequence logprobs (sums over response tokens), shape [pairs]."""
    margin = (chosen_logprobs - ref_chosen_logprobs) - (rejected_logprobs - ref_rejected_logprobs)
    return -F.logsigmoid(beta * margin)


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate per token, with an asymmetric range [1 - eps_low, 1 + eps_high] (DAPO).

    Returns (loss, clipped) where `clipped` is 1.0 where the clipped branch was taken.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float()


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """Clipped value loss per token: 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2)."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) on tokens sampled from the policy.

    k1 = log p - log q (unbiased, high variance, can be negative);
    k3 = q/p - log(q/p) - 1 (unbiased, non-negative, Schulman's estimator).
    """
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kl_estimator: unknown estimator {estimator!r}")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dimension, computed in float32."""
    logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(-1)


def distill_reverse_kl(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation: per-token reverse KL(student || teacher) on the student's samples.

    The sampled-token estimate of the reverse KL, `old - teacher`, is used as a negative
    per-token advantage in an importance-weighted policy gradient, so the gradient is
    (log p - log q) * grad log p: the score-function gradient of the per-token reverse KL.
    Returns (loss, reverse_kl): the loss to minimise and the KL estimate (for metrics).
    """
    reverse_kl = (old_logprobs - teacher_logprobs).detach()
    ratio = torch.exp(logprobs - old_logprobs.detach())
    return ratio * reverse_kl, reverse_kl


def tis_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling: min(pi_prox / pi_behav, cap), detached.

    Corrects the mismatch between the rollout engine's logprobs (behaviour) and the trainer's
    own recomputation (proximal) by truncating large weights at `cap` (keeps every token).
    """
    return torch.exp(proximal_logprobs - behaviour_logprobs).detach().clamp(max=cap)


def decoupled_weights(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Decoupled PPO (behaviour vs proximal policy): pi_prox / pi_behav, detached.

    Tokens whose weight exceeds `cap` are dropped (weight 0) rather than truncated, as in
    AReaL's decoupled objective; the PPO ratio itself is taken against the proximal policy.
    """
    weights = torch.exp(proximal_logprobs - behaviour_logprobs).detach()
    return torch.where(weights <= cap, weights, torch.zeros_like(weights))
