"""Off-policy correction in `Learner.prepare` (and in the step, when pi_prox is the step's own forward): the tokens the
rejection rules and M2PO mask out of this rank's rows of each mini-batch (on pi_prox vs pi_rollout), the loss weights
taken again over what is kept (counts summed over ranks), and the importance weights (docs/algorithms.md)."""

import torch

from trainer.batch import TrainBatch
from trainer.config.algorithm import AlgorithmConfig
from trainer.corrections import (
    chained_rejection_mask,
    decoupled_weights,
    is_weight_moments,
    m2po_mask,
    normalize_is_weights,
    tis_weights,
)
from trainer.losses import loss_totals, loss_weights
from trainer.parallel import DistEnv


def reject(batch: TrainBatch, algo: AlgorithmConfig, env: DistEnv, per_rank: int, longest: list[torch.Tensor]) -> None:
    """Rejection sampling on pi_prox vs pi_rollout (this rank's rows, `per_rank` a mini-batch): rejected tokens leave
    the loss mask, and the loss weights are recomputed with each mini-batch's kept-token counts summed over ranks."""
    log_ratio = batch.old_logprobs - batch.rollout_logprobs
    kept = chained_rejection_mask(log_ratio, batch.loss_mask, algo.rejection)
    if algo.m2_threshold is not None:
        kept = kept * m2po_rows(env, log_ratio, batch.loss_mask, per_rank, algo.m2_threshold)
    batch.rejected = batch.loss_mask - kept
    batch.loss_mask = kept
    steps = range(0, batch.num_rows, per_rank)
    counts = torch.stack([torch.stack(loss_totals(kept[start : start + per_rank])[:2]) for start in steps]).double()
    counts = env.all_reduce_sum(counts)
    for m, start in enumerate(steps):
        rows = slice(start, start + per_rank)
        tokens, seqs = counts[m].to(kept.dtype).unbind()
        batch.loss_weights[rows] = loss_weights(
            kept[rows], algo.loss_agg, algo.loss_norm_length, algo.loss_norm_seqs, (tokens, seqs, longest[m]),
        )
        batch.token_weights[rows] = loss_weights(kept[rows], "token_mean", totals=(tokens, seqs, longest[m]))


def m2po_rows(env: DistEnv, log_ratio: torch.Tensor, mask: torch.Tensor, per_rank: int, threshold: float) -> torch.Tensor:
    """M2PO's mask of this rank's rows, taken over each whole mini-batch: every rank's rows of it are gathered
    (a sum of zero-padded copies), so the tokens dropped do not depend on the data-parallel split."""
    dp, rank = env.dp_size, env.dp_rank
    shared = torch.zeros(2, dp, *mask.shape, dtype=torch.float64)
    shared[0, rank], shared[1, rank] = log_ratio.double() * mask, mask.double()
    ratios, masks = env.all_reduce_sum(shared).unbind()
    kept = torch.empty_like(mask)
    for start in range(0, mask.shape[0], per_rank):
        rows = slice(start, start + per_rank)
        step_kept = m2po_mask(ratios[:, rows].flatten(0, 1), masks[:, rows].flatten(0, 1), threshold)
        kept[rows] = step_kept.view(dp, -1, mask.shape[1])[rank].to(mask.dtype)
    return kept


def set_off_policy_correction(batch: TrainBatch, algo: AlgorithmConfig, env: DistEnv, mask: torch.Tensor) -> None:
    """The policy the ratio is taken against, and importance weights for asynchronous data (docs/algorithms.md).

    Weights are taken on `mask`, the loss mask before rejection, and batch-normalised over it (verl's order), then
    rejected tokens weigh 0. bypass's weights and rejection are the objective's (current policy)."""
    if algo.off_policy in ("none", "bypass"):
        batch.old_logprobs = batch.rollout_logprobs
        return
    if algo.off_policy == "recompute":
        return
    weights = tis_weights if algo.off_policy == "tis" else decoupled_weights
    is_weights = weights(batch.old_logprobs, batch.rollout_logprobs, algo.is_cap, mask, algo.is_level)
    if algo.is_batch_normalize:
        moments = env.all_reduce_sum(is_weight_moments(is_weights, mask, algo.is_level))
        is_weights = normalize_is_weights(is_weights, moments)
    batch.is_weights = is_weights * batch.loss_mask
