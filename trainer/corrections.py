"""Off-policy corrections: importance weights and rejection masks between the trainer's policy and the rollout's
(verl's rollout_corr_helper, AReaL's decoupled objective and M2PO's second-moment mask): pure tensor functions.

Per-token tensors have shape [batch, tokens] with a float `mask` (1 = a trained-on response token), as in
trainer/losses.py.
"""

import math

import torch

from trainer.config.algorithm import RejectionStatistic
from trainer.losses import LOG_RATIO_BOUND, ISLevel, masked_mean, masked_sum


def _level_log_ratio(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, mask: torch.Tensor | None,
                     level: ISLevel) -> torch.Tensor:
    """log pi_prox - log pi_behav per token, or per sequence (its sum over `mask`, on each of its tokens)."""
    log_ratio = proximal_logprobs - behaviour_logprobs
    if level == "sequence":
        if mask is None:
            raise ValueError("sequence-level importance weights need the loss mask")
        return masked_sum(log_ratio, mask, -1).unsqueeze(-1).expand_as(proximal_logprobs)
    if level != "token":
        raise ValueError(f"is_level: unknown level {level!r}")
    return log_ratio


def tis_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    cap: float,
    mask: torch.Tensor | None = None,
    level: ISLevel = "token",
) -> torch.Tensor:
    """Truncated importance sampling: min(pi_prox / pi_behav, cap), detached (verl's rollout_is).

    Corrects the mismatch between the rollout engine's logprobs (behaviour) and the trainer's own
    recomputation (proximal) by truncating large weights at `cap` (keeps every token). `level`:
    token = a weight per token; sequence = one weight per sequence, the product of its token ratios
    (needs `mask`). Log-ratios are clamped to +-20 (per token, or the sequence's sum) before exp.
    Masked-out tokens get weight 0 when `mask` is given.
    """
    log_ratio = _level_log_ratio(proximal_logprobs, behaviour_logprobs, mask, level)
    weights = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    if mask is not None:
        weights = weights * mask
    return weights.clamp(max=cap).detach()


def is_weight_moments(weights: torch.Tensor, mask: torch.Tensor, level: ISLevel = "token") -> torch.Tensor:
    """[sum, count] of the importance weights (float64) that batch normalisation divides by, summable across ranks.

    token: over all trained tokens; sequence: over sequences with a trained token, each counted once
    (its weight's mean over its tokens), as verl's rollout_is_batch_normalize.
    """
    weights64, mask64 = weights.double(), mask.double()
    if level == "token":
        return torch.stack([(weights64 * mask64).sum(), mask64.sum()])
    seq_weights = masked_mean(weights64, mask64, -1)
    has_tokens = (mask64.sum(-1) > 0).double()
    return torch.stack([(seq_weights * has_tokens).sum(), has_tokens.sum()])


def normalize_is_weights(weights: torch.Tensor, moments: torch.Tensor) -> torch.Tensor:
    """Importance weights divided by their batch mean (from `is_weight_moments`), so they average 1.

    Left as they are when the mean is not above 1e-8 (verl's rule)."""
    total, count = moments.unbind()
    mean = total / count.clamp(min=1e-8)
    return (weights.double() / mean).to(weights.dtype) if mean > 1e-8 else weights


def rejection_mask(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    statistic: RejectionStatistic,
    upper: float,
    lower: float | None = None,
) -> torch.Tensor:
    """`mask` with the tokens (token_*) or whole sequences (seq_*) whose divergence statistic is out of
    bounds set to 0 (verl's rollout_rs; chain several by multiplying their masks).

    `log_ratio` = log pi_prox - log pi_behav, clamped to +-20. Per token, as verl defines them:
    k1 = -log_ratio, k2 = 0.5 log_ratio^2, k3 = exp(log_ratio) - 1 - log_ratio. Sequence statistics
    are the sum, mean or max of the token statistic over the sequence's trained tokens. A k2/k3
    statistic is kept while <= `upper`; a k1 statistic while log(lower) <= k1 <= log(upper), i.e.
    `lower` and `upper` bound the ratio pi_behav / pi_prox (lower defaults to 1 / upper).
    """
    log_ratio = torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    level, _, estimator = statistic.rpartition("_")
    if estimator == "k1":
        token_stat = -log_ratio
    elif estimator == "k2":
        token_stat = 0.5 * log_ratio**2
    elif estimator == "k3":
        token_stat = torch.exp(log_ratio) - 1.0 - log_ratio
    else:
        raise ValueError(f"rejection: unknown statistic {statistic!r}")
    if level == "token":
        stat = token_stat
    elif level == "seq_sum":
        stat = masked_sum(token_stat, mask, -1).unsqueeze(-1)
    elif level == "seq_mean":
        stat = masked_mean(token_stat, mask, -1).unsqueeze(-1)
    elif level == "seq_max" and estimator != "k1":
        masked = token_stat.masked_fill(mask <= 0, -torch.inf).max(-1, keepdim=True).values
        stat = torch.where(torch.isinf(masked), torch.zeros_like(masked), masked)
    else:
        raise ValueError(f"rejection: unknown statistic {statistic!r}")
    if estimator == "k1":
        keep = (stat >= math.log(lower if lower is not None else 1.0 / upper)) & (stat <= math.log(upper))
    else:
        keep = stat <= upper
    return mask * keep.to(mask.dtype).expand_as(mask)


def chained_rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, rules) -> torch.Tensor:
    """`mask` with every token or sequence that any of `rules` rejects set to 0: each rule (an object with
    statistic, upper, lower) on the original mask, the masks multiplied, as verl's comma-separated rollout_rs."""
    kept = mask
    for rule in rules:
        kept = kept * rejection_mask(log_ratio, mask, rule.statistic, rule.upper, rule.lower)
    return kept


def decoupled_weights(
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    cap: float,
    mask: torch.Tensor | None = None,
    level: ISLevel = "token",
) -> torch.Tensor:
    """Masked importance sampling (decoupled PPO, behaviour vs proximal policy): pi_prox / pi_behav, detached,
    with weights above `cap` dropped (weight 0) rather than truncated, as AReaL's decoupled objective (MIS).

    `level` as `tis_weights`: sequence = the product of the sequence's token ratios, the whole sequence
    dropped when it exceeds the cap (needs `mask`). Masked-out tokens get weight 0 when `mask` is given.
    """
    log_ratio = _level_log_ratio(proximal_logprobs, behaviour_logprobs, mask, level)
    if level == "sequence":
        log_ratio = torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    weights = torch.exp(log_ratio).detach()
    weights = torch.where(weights <= cap, weights, torch.zeros_like(weights))
    return weights * mask if mask is not None else weights


def m2po_mask(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """`mask` with the tokens of largest second moment M2 = (log pi_prox - log pi_behav)^2 set to 0, the fewest such
    that the mean M2 of the tokens kept is below `threshold` (M2PO, Zheng et al. 2025, arXiv 2510.01161; the rule of
    AReaL's get_m2po_loss_mask). Taken over every trained token of `mask` together; when even the smallest M2 is not
    below the threshold, every token goes. Equal M2 values are dropped in the order torch.sort puts them."""
    m2 = (torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND) ** 2).double()
    trained = mask > 0
    values = m2[trained]
    if values.numel() == 0:
        return mask
    ordered, order = torch.sort(values, descending=True)
    tail_means = ordered.flip(0).cumsum(0).flip(0) / torch.arange(values.numel(), 0, -1, dtype=ordered.dtype)
    below = torch.nonzero(tail_means < threshold)
    dropped = int(below[0]) if below.numel() else values.numel()
    keep = torch.ones_like(values, dtype=torch.bool)
    keep[order[:dropped]] = False
    kept = torch.zeros_like(trained)
    kept[trained] = keep
    return mask * kept.to(mask.dtype)
