"""Per-token losses and their aggregation: pure tensor functions, each written once (off-policy corrections:
trainer/corrections.py).

Per-token tensors have shape [batch, tokens] and come with a float `mask` of the same shape
(1 = a trained-on response token). Losses return per-token values; `aggregate` turns them into
one scalar. Aggregation is expressed as per-token weights (`loss_weights`) so that a loss split
over micro-batches and data-parallel ranks sums back to exactly the full-batch loss.

Each function follows a reference implementation (verl's `trainer/ppo/core_algos.py` and
`rollout_corr_helper.py`, TRL's `DPOTrainer`) and tests/test_reference_*.py checks it against
numbers computed by that code; where a convention differs, the docstring says so.
"""

from typing import Literal

import torch
import torch.nn.functional as F

LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3", "abs"]
DPOLossType = Literal["sigmoid", "ipo", "hinge"]
ISLevel = Literal["token", "sequence"]

# Log-ratios are clamped to +-LOG_RATIO_BOUND before exp (verl's bound): one outlier token cannot overflow.
LOG_RATIO_BOUND = 20.0
# The k3 estimator is clamped to +-K3_BOUND (verl): zero gradient beyond, so one token cannot blow up a step.
K3_BOUND = 10.0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over masked entries; 0 where nothing is masked in (never NaN)."""
    return masked_sum(values, mask, dim) / mask.sum(dim).clamp(min=1)


def loss_weights(
    mask: torch.Tensor,
    agg: LossAgg,
    norm_length: float | None = None,
    norm_seqs: bool = False,
    totals: "LossTotals | None" = None,
) -> torch.Tensor:
    """Per-token weights w with `aggregate(x) == (x * w).sum()` for the whole batch (verl's `agg_loss`).

    - token_mean: every trained token counts the same (DAPO's token-level loss);
    - seq_mean_token_sum: each sequence's token sum, then mean over sequences;
    - seq_mean_token_mean: mean over each sequence's tokens, then over sequences (GRPO);
    - seq_mean_token_sum_norm: the sum over all tokens divided by a constant `norm_length` (Dr. GRPO).
      As verl's, it does not divide by the number of sequences; `norm_seqs=True` does (the Dr. GRPO
      paper's 1/G). verl's default constant is the padded response width (its configured maximum
      response length); ours, `norm_length=None`, is the longest response in the batch: set
      `norm_length` to the maximum response length to match verl.
    Sequences with no trained token get weight 0 and do not count in a sequence mean.

    The batch is the whole mini-batch (all micro-batches and ranks), so the loss does not depend on
    how it is split; verl computes its sequence means per micro-batch (or from its global batch info).
    `mask` may be one rank's share of it when `totals` gives the whole mini-batch's counts (`loss_totals`,
    summed over ranks) and the longest response (the seq_mean_token_sum_norm constant when norm_length is None).
    """
    mask = mask.float()
    tokens_per_seq = mask.sum(-1, keepdim=True)
    if totals is None:
        totals = loss_totals(mask)
    num_tokens, num_seqs, longest = (value.clamp(min=1) for value in totals)
    if agg == "token_mean":
        return mask / num_tokens
    if agg == "seq_mean_token_sum":
        return mask / num_seqs
    if agg == "seq_mean_token_mean":
        return mask / tokens_per_seq.clamp(min=1) / num_seqs
    if agg == "seq_mean_token_sum_norm":
        length = norm_length if norm_length is not None else longest
        return mask / length / (num_seqs if norm_seqs else 1)
    raise ValueError(f"loss_agg: unknown aggregation {agg!r}")


LossTotals = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def loss_totals(mask: torch.Tensor, longest: torch.Tensor | None = None) -> LossTotals:
    """(trained tokens, sequences with a trained token, longest response) of `mask`, as `loss_weights` divides
    by them. The first two sum across ranks; `longest` may be given (the mini-batch's, before rejection)."""
    tokens_per_seq = mask.float().sum(-1)
    if longest is None:
        longest = tokens_per_seq.max() if tokens_per_seq.numel() else torch.zeros(())
    return tokens_per_seq.sum(), (tokens_per_seq > 0).sum().to(tokens_per_seq.dtype), longest


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, agg: LossAgg, norm_length: float | None = None, norm_seqs: bool = False
) -> torch.Tensor:
    """One scalar from per-token values (see `loss_weights`)."""
    return (values * loss_weights(mask, agg, norm_length, norm_seqs)).sum()


def sft_loss(logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood of the response tokens."""
    return -logprobs


def dpo_loss(
    chosen_logprobs: torch.Tensor,
    rejected_logprobs: torch.Tensor,
    ref_chosen_logprobs: torch.Tensor,
    ref_rejected_logprobs: torch.Tensor,
    beta: float,
    loss_type: DPOLossType = "sigmoid",
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-pair DPO loss from sequence logprobs (sums over response tokens), shape [pairs] (TRL's DPOTrainer).

    With the margin d = (chosen - ref_chosen) - (rejected - ref_rejected):
    - sigmoid: -log sigmoid(beta * d) (the DPO paper);
    - hinge: relu(1 - beta * d) (SLiC);
    - ipo: (d' - 1 / (2 beta))^2 where d' uses each sequence's log-ratio divided by its number of
      response tokens (`chosen_tokens`, `rejected_tokens`, at least 1), as TRL does.
    """
    chosen_scores = chosen_logprobs - ref_chosen_logprobs
    rejected_scores = rejected_logprobs - ref_rejected_logprobs
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * (chosen_scores - rejected_scores))
    if loss_type == "hinge":
        return torch.relu(1 - beta * (chosen_scores - rejected_scores))
    if loss_type == "ipo":
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("dpo_loss_type 'ipo' needs the number of response tokens of each sequence")
        delta = chosen_scores / chosen_tokens.clamp(min=1) - rejected_scores / rejected_tokens.clamp(min=1)
        return (delta - 1 / (2 * beta)) ** 2
    raise ValueError(f"dpo_loss_type: unknown loss {loss_type!r}")


def ppo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
    clip_ratio_c: float | None = 3.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Clipped surrogate per token with an asymmetric range [1 - eps_low, 1 + eps_high] (DAPO) and
    dual clip (Ye et al. 2019): for a negative advantage the loss is at most -A * clip_ratio_c.

    As verl's `compute_policy_loss_vanilla`: the log-ratio is clamped to +-20 before exp, and
    `clip_ratio_c` (> 1) defaults to 3; None turns the dual clip off.
    Returns (loss, clipped, dual_clipped): 1.0 where the clipped branch, and where the dual clip, was taken.
    """
    log_ratio = torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped)
    clipped_taken = (clipped > unclipped).float()
    if clip_ratio_c is None:
        return loss, clipped_taken, torch.zeros_like(loss)
    lower_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    dual_clipped = (negative & (loss > lower_bound)).float()
    return torch.where(negative, torch.minimum(loss, lower_bound), loss), clipped_taken, dual_clipped


def gspo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO (Zheng et al. 2025): the clipped surrogate on the sequence-level ratio
    s_i = exp(mean over i's tokens of (log p - log p_old)), as verl's `compute_policy_loss_gspo`.

    Per token the ratio is sg[s_i] * p / sg[p], so each token's gradient is s_i * grad log p; the log
    of it is clamped at 10. GSPO averages per sequence: aggregate with seq_mean_token_mean, as verl does.
    Rows need all their tokens (a row is never split across micro-batches). Returns (loss, clipped).
    """
    seq_log_ratio = masked_sum(logprobs - old_logprobs, mask, -1) / mask.sum(-1).clamp(min=1)
    log_ratio = logprobs - logprobs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def cispo_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) * A * log p, as verl's
    `compute_policy_loss_cispo`: every token keeps a gradient; only the weight is clipped.
    Returns (loss, clipped): 1.0 where the ratio was outside the range."""
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    return -clipped_ratio.detach() * advantages * logprobs, (ratio != clipped_ratio).float()


def sapo_policy_loss(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float
) -> torch.Tensor:
    """SAPO (Qwen 2025): a smooth gate instead of the clip, -f(ratio) * A with f(r) = sigmoid(tau (r - 1)) * 4 / tau,
    tau = tau_pos where A > 0 and tau_neg elsewhere, as verl's `compute_policy_loss_sapo` (log-ratio clamped
    to +-20). verl aggregates it by seq_mean_token_mean."""
    ratio = torch.exp(torch.clamp(logprobs - old_logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    taus = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    return -torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus) * advantages


def reinforce_loss(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """REINFORCE: -A * log p per token, no ratio and no clip (verl's compute_policy_loss_reinforce; its
    importance weights, when given, multiply this as every correction here does)."""
    return -advantages * logprobs


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """Clipped value loss per token: 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2) (verl's compute_value_loss)."""
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    return 0.5 * torch.maximum((values - returns) ** 2, (clipped_values - returns) ** 2)


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: KLEstimator) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) on tokens sampled from the policy (Schulman 2020), as verl's.

    k1 = log p - log q (unbiased, high variance, can be negative); abs = |k1|; k2 = 0.5 * k1^2;
    k3 = q/p - log(q/p) - 1 (unbiased, non-negative), with log(q/p) clamped to +-20 and k3 to +-10.
    """
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "abs":
        return log_ratio.abs()
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        reverse = torch.clamp(-log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.clamp(torch.exp(reverse) - reverse - 1.0, -K3_BOUND, K3_BOUND)
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
