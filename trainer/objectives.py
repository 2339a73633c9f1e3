"""Each algorithm's objective on one micro-batch: policy outputs + batch -> (loss, metric sums).

Every term is a weighted sum with weights computed over the whole mini-batch (batch.loss_weights,
batch.token_weights), so losses and metrics of micro-batches and ranks add up to the full-batch
values. Metrics come back as sums to be added across micro-batches and ranks.
"""

import torch

from trainer.batch import TrainBatch
from trainer.config.algorithm import AlgorithmConfig
from trainer.corrections import chained_rejection_mask, tis_weights
from trainer.losses import (
    LOG_RATIO_BOUND,
    cispo_policy_loss,
    distill_reverse_kl,
    dpo_loss,
    gspo_policy_loss,
    kl_penalty,
    ppo_policy_loss,
    reinforce_loss,
    sapo_policy_loss,
    sft_loss,
    value_loss,
)
from trainer.model import PolicyOutput

Metrics = dict[str, torch.Tensor]


def objective(algo: AlgorithmConfig, batch: TrainBatch, out: PolicyOutput) -> tuple[torch.Tensor, Metrics]:
    """The configured algorithm's loss plus the optional KL and entropy terms."""
    loss, metrics = ALGORITHMS[algo.name](algo, batch, out)
    tokens = batch.token_weights
    metrics["entropy"] = (out.entropy.detach() * tokens).sum()
    if algo.entropy_coef > 0:
        loss = loss - algo.entropy_coef * (out.entropy * batch.loss_weights).sum()
    if algo.kl_coef > 0:
        kl = kl_penalty(out.logprobs, batch.ref_logprobs, algo.kl_estimator)
        loss = loss + algo.kl_coef * (kl * batch.loss_weights).sum()
        metrics["kl"] = (kl.detach() * tokens).sum()
    metrics["loss"] = loss.detach()
    return loss, metrics


def sft(algo: AlgorithmConfig, batch: TrainBatch, out: PolicyOutput) -> tuple[torch.Tensor, Metrics]:
    nll = sft_loss(out.logprobs)
    return (nll * batch.loss_weights).sum(), {"nll": (nll.detach() * batch.token_weights).sum()}


def dpo(algo: AlgorithmConfig, batch: TrainBatch, out: PolicyOutput) -> tuple[torch.Tensor, Metrics]:
    """Rows come as (chosen, rejected) pairs; a pair weighs what its two rows weigh."""
    sequence_logprobs = (out.logprobs * batch.loss_mask).sum(-1)
    ref_sequence_logprobs = (batch.ref_logprobs * batch.loss_mask).sum(-1)
    tokens = batch.loss_mask.sum(-1)
    pair_weights = batch.row_weights[0::2] + batch.row_weights[1::2]
    losses = dpo_loss(
        sequence_logprobs[0::2], sequence_logprobs[1::2], ref_sequence_logprobs[0::2], ref_sequence_logprobs[1::2],
        algo.dpo_beta, algo.dpo_loss_type, tokens[0::2], tokens[1::2],
    )
    margins = algo.dpo_beta * (
        (sequence_logprobs[0::2] - ref_sequence_logprobs[0::2]) - (sequence_logprobs[1::2] - ref_sequence_logprobs[1::2])
    ).detach()
    return (losses * pair_weights).sum(), {
        "reward_margin": (margins * pair_weights).sum(),
        "reward_accuracy": ((margins > 0).float() * pair_weights).sum(),
    }


def policy_gradient(algo: AlgorithmConfig, batch: TrainBatch, out: PolicyOutput) -> tuple[torch.Tensor, Metrics]:
    """GRPO and PPO's policy part (algo.policy_loss), off-policy weighted when configured."""
    losses, clipped, dual_clipped = policy_term(algo, batch, out)
    metrics: Metrics = {}
    if algo.off_policy == "bypass":
        losses = losses * bypass_correction(algo, batch, out, metrics)
    if batch.is_weights is not None:
        losses = losses * batch.is_weights
        metrics["is_weight"] = (batch.is_weights * batch.token_weights).sum()
    if batch.rejected is not None:
        metrics["rejected_tokens"] = batch.rejected.sum()
    metrics |= {
        "clip_fraction": (clipped * batch.token_weights).sum(),
        "dual_clip_fraction": (dual_clipped * batch.token_weights).sum(),
        "ratio": (torch.exp((out.logprobs - batch.old_logprobs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)).detach()
                  * batch.token_weights).sum(),
    }
    return (losses * batch.loss_weights).sum(), metrics


def bypass_correction(algo: AlgorithmConfig, batch: TrainBatch, out: PolicyOutput, metrics: Metrics) -> torch.Tensor:
    """verl's bypass mode (old = rollout logprobs, no recompute): per-token factors of the loss from the current
    policy (detached) against the rollout's, taken on this micro-batch: the rejection mask (algo.rejection; the
    rejected tokens keep their place in the normalisation, fixed before the step), times the truncated importance
    weights for policy_loss reinforce (a ratio loss corrects by its own ratio: verl applies no weights there)."""
    current = out.logprobs.detach()
    kept = chained_rejection_mask(current - batch.rollout_logprobs, batch.loss_mask, algo.rejection)
    if algo.rejection:
        metrics["rejected_tokens"] = (batch.loss_mask - kept).sum()
    if algo.policy_loss != "reinforce":
        return kept
    weights = tis_weights(current, batch.rollout_logprobs, algo.is_cap, batch.loss_mask, algo.is_level)
    metrics["is_weight"] = (weights * batch.token_weights).sum()
    return kept * weights


def policy_term(algo: AlgorithmConfig, batch: TrainBatch, out: PolicyOutput) -> tuple[torch.Tensor, ...]:
    """Per-token policy loss and where it was clipped / dual-clipped (1.0), for algo.policy_loss."""
    logprobs, old, advantages = out.logprobs, batch.old_logprobs, batch.advantages
    if algo.policy_loss == "ppo":
        return ppo_policy_loss(logprobs, old, advantages, algo.clip_eps_low, algo.clip_eps_high, algo.clip_ratio_c)
    none = torch.zeros_like(logprobs)
    if algo.policy_loss == "gspo":
        return (*gspo_policy_loss(logprobs, old, advantages, batch.loss_mask, algo.clip_eps_low, algo.clip_eps_high), none)
    if algo.policy_loss == "cispo":
        return (*cispo_policy_loss(logprobs, old, advantages, algo.clip_eps_low, algo.clip_eps_high), none)
    if algo.policy_loss == "sapo":
        return sapo_policy_loss(logprobs, old, advantages, algo.sapo_tau_pos, algo.sapo_tau_neg), none, none
    return reinforce_loss(logprobs, advantages), none, none


def ppo(algo: AlgorithmConfig, batch: TrainBatch, out: PolicyOutput) -> tuple[torch.Tensor, Metrics]:
    loss, metrics = policy_gradient(algo, batch, out)
    values = value_loss(out.values, batch.old_values, batch.returns, algo.value_clip_eps)
    metrics["value_loss"] = (values.detach() * batch.token_weights).sum()
    return loss + algo.value_coef * (values * batch.loss_weights).sum(), metrics


def distill(algo: AlgorithmConfig, batch: TrainBatch, out: PolicyOutput) -> tuple[torch.Tensor, Metrics]:
    losses, reverse_kl = distill_reverse_kl(out.logprobs, batch.old_logprobs, batch.ref_logprobs)
    metrics = {"reverse_kl": (reverse_kl * batch.token_weights).sum()}
    if batch.is_weights is not None:
        losses = losses * batch.is_weights
    if batch.rejected is not None:
        metrics["rejected_tokens"] = batch.rejected.sum()
    return (losses * batch.loss_weights).sum(), metrics


ALGORITHMS = {"sft": sft, "dpo": dpo, "grpo": policy_gradient, "ppo": ppo, "distill": distill}
