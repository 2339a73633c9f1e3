"""The learner: policy (+ reference), optimizer, and the two verbs of training on a batch.

`prepare(samples)` turns a pulled batch into this rank's ready mini-batches (advantages,
recomputed logprobs, reference logprobs, loss weights); `train_step(mini_batch, step)` runs
one optimizer step over it with gradient accumulation and clipping and returns metrics that
are already summed over ranks.
"""

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from protos.sample import Sample
from services.device import autocast, fused_optimizer
from trainer.advantages import (
    discounted_returns,
    gae,
    kl_reward_penalty,
    masked_moments,
    sequence_advantages,
    terminal_rewards,
    varied_groups,
    whiten,
)
from trainer.batch import (
    TrainBatch,
    collate,
    group_indices,
    order_preference_pairs,
    pack_by_tokens,
    pad_rows,
    plan_mini_batches,
    split_packs,
)
from trainer.config import TrainerConfig
from trainer.corrections import (
    chained_rejection_mask,
    decoupled_weights,
    is_weight_moments,
    m2po_mask,
    normalize_is_weights,
    tis_weights,
)
from trainer.losses import loss_totals, loss_weights
from trainer.mismatch import largest_over_ranks, mismatch_metrics, mismatch_sums
from trainer.model import Packing, PolicyModel, PolicyOutput, run_policy
from trainer.objectives import objective
from trainer.packing import pack_by_token_sum
from trainer.parallel import DistEnv, build_policy
from trainer.varlen import use_varlen


class Learner:
    """Owns the (sharded) policy, the frozen reference if any, and the optimizer."""

    def __init__(self, config: TrainerConfig, env: DistEnv) -> None:
        if config.parallel.tp != env.tp_size:
            raise ValueError(f"parallel.tp={config.parallel.tp}, but the process group was made with tp={env.tp_size}")
        config.batch.check_divisible(env.dp_size)
        self.config = config
        self.algo = config.algorithm
        self.env = env
        torch.manual_seed(config.seed)
        self.policy: PolicyModel = build_policy(config.model_path, env, config.parallel, config.model,
                                                value_head=self.algo.name == "ppo", dtype=config.dtype)
        self.pad_id = self.policy.lm.config.pad_token_id or 0
        self.packing = Packing(config.batch.pack_row_tokens, self.pad_id) if config.batch.packing else None
        self.reference: PolicyModel | None = None
        if config.ref_model_path is not None and self.algo.needs_reference:
            self.reference = build_policy(config.ref_model_path, env, config.parallel, config.model, trainable=False,
                                          dtype=config.dtype)
        if self.packing is not None and config.batch.packed_attention == "varlen":
            for model in filter(None, (self.policy, self.reference)):
                use_varlen(model.lm)
        # One optimizer step per pulled batch: the proximal policy is the one the step starts from, so its
        # logprobs are the training forward's, detached (verl's on_policy path), not a second forward pass. Not
        # when something needs them before the step: rejection or batch-normalised weights (whole mini-batch),
        # a KL reward penalty (advantages), PPO's values.
        algo = self.algo
        self.proximal_in_step = (algo.recomputes_logprobs and algo.name != "ppo" and config.batch.mini_batches == 1
                                 and not algo.rejection and not algo.is_batch_normalize and algo.kl_reward_coef == 0)
        optim = config.optim
        # Dynamic sampling's counts: the last pulled batch's (added to each of its steps' metrics) and running totals.
        self.batch_metrics: dict[str, float] = {}
        self.dropped_totals = {"dropped_groups_total": 0.0, "dropped_samples_total": 0.0}
        # The fused kernel: one pass over each parameter instead of a dozen ops (~1 ms of the quickstart's 27 ms
        # step on one CPU thread); the same update up to float rounding.
        self.optimizer = torch.optim.AdamW(
            self.policy.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay,
            fused=fused_optimizer(env.device),
        )

    # -- preparing a pulled batch -------------------------------------------------------------

    def prepare(self, samples: Sequence[Sample]) -> list[TrainBatch]:
        """This rank's mini-batches of a pulled batch, with everything the objective reads.

        A batch may hold any number of samples: fewer than batch.global_batch_size (a group lost a
        FAILED member, the next group did not fit) or more (one group larger than the batch). Every
        rank holds the whole pulled batch: sequence-level quantities (GRPO advantages, loss weights)
        are computed over the real samples of each mini-batch, which is then padded with zero-weight
        rows to a multiple of the world size, so every rank runs the same steps and micro-batches
        and the padding counts in no loss or metric. FAILED samples are the caller's to filter out.

        The order follows verl's: recompute (proximal logprobs, values, reference), KL reward penalty,
        rejection (masks tokens out of advantages and normalisation), advantages, importance weights.
        """
        samples = self._dynamic_sampling(samples)
        if not samples:
            return []
        if self.algo.name == "dpo":
            samples = order_preference_pairs(samples)
        batch = collate(samples, self.pad_id, self.policy.vision)
        chunks, per_step = plan_mini_batches(
            batch.num_rows, self.config.batch.mini_batches, self.env.dp_size, unit=2 if self.algo.name == "dpo" else 1
        )
        batch = pad_rows(batch, chunks, per_step)
        real = batch.row_weights > 0
        longest = self._set_weights(batch, per_step)
        rows = self._local_rows(len(chunks), per_step)
        local = batch.select(rows)
        self._recompute(local)
        if (self.algo.rejection or self.algo.m2_threshold is not None) and self.algo.off_policy != "bypass":
            self._reject(local, per_step // self.env.dp_size, longest)
        if self.algo.advantage_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
            self._sequence_advantages(local, batch, real, rows)
        elif self.algo.advantage_estimator is not None:
            self._token_advantages(local)
        if self.algo.name in ("grpo", "ppo", "distill") and not self.proximal_in_step:
            self._set_off_policy_correction(local)
        per_rank = per_step // self.env.dp_size
        return [local.select(slice(m * per_rank, (m + 1) * per_rank)) for m in range(len(chunks))]

    def _dynamic_sampling(self, samples: Sequence[Sample]) -> Sequence[Sample]:
        """DAPO: drop the groups whose rewards are all equal (they have no learning signal); counted."""
        self.batch_metrics = {}
        if not self.algo.dynamic_sampling or not samples:
            return samples
        group_ids = [s.group_id for s in samples]
        keep = varied_groups(torch.tensor([s.reward for s in samples], dtype=torch.float64), group_indices(group_ids))
        kept = [sample for sample, varied in zip(samples, keep.tolist(), strict=True) if varied]
        dropped = {"dropped_groups": float(len(set(group_ids)) - len({s.group_id for s in kept})),
                   "dropped_samples": float(len(samples) - len(kept))}
        for name, count in dropped.items():
            self.dropped_totals[f"{name}_total"] += count
        self.batch_metrics = {**dropped, **self.dropped_totals}
        return kept

    def _set_weights(self, batch: TrainBatch, per_step: int) -> list[torch.Tensor]:
        """Loss/metric weights computed over each whole mini-batch (all ranks' rows); padding rows
        (loss_mask 0, see pad_rows) weigh 0 and count in no normalisation. Returns each mini-batch's
        longest response (the seq_mean_token_sum_norm constant, kept when rejection masks tokens)."""
        real = batch.row_weights  # pad_rows: 1 for a sample, 0 for padding
        batch.loss_weights = torch.zeros_like(batch.loss_mask)
        batch.token_weights = torch.zeros_like(batch.loss_mask)
        batch.row_weights = torch.zeros_like(batch.rewards)
        longest = []
        for start in range(0, batch.num_rows, per_step):
            rows = slice(start, start + per_step)
            mask = batch.loss_mask[rows]
            batch.loss_weights[rows] = loss_weights(
                mask, self.algo.loss_agg, self.algo.loss_norm_length, self.algo.loss_norm_seqs
            )
            batch.token_weights[rows] = loss_weights(mask, "token_mean")
            batch.row_weights[rows] = real[rows] / real[rows].sum()
            longest.append(loss_totals(mask)[2])
        return longest

    def _reject(self, batch: TrainBatch, per_rank: int, longest: list[torch.Tensor]) -> None:
        """Rejection sampling on pi_prox vs pi_rollout (this rank's rows): rejected tokens leave the loss mask, and
        the loss weights are recomputed with each mini-batch's kept-token counts summed over ranks."""
        log_ratio = batch.old_logprobs - batch.rollout_logprobs
        kept = chained_rejection_mask(log_ratio, batch.loss_mask, self.algo.rejection)
        if self.algo.m2_threshold is not None:
            kept = kept * self._m2po_mask(log_ratio, batch.loss_mask, per_rank)
        batch.rejected = batch.loss_mask - kept
        batch.loss_mask = kept
        steps = range(0, batch.num_rows, per_rank)
        counts = torch.stack([torch.stack(loss_totals(kept[start : start + per_rank])[:2]) for start in steps]).double()
        counts = self.env.all_reduce_sum(counts)
        for m, start in enumerate(steps):
            rows = slice(start, start + per_rank)
            tokens, seqs = counts[m].to(kept.dtype).unbind()
            batch.loss_weights[rows] = loss_weights(
                kept[rows], self.algo.loss_agg, self.algo.loss_norm_length, self.algo.loss_norm_seqs,
                (tokens, seqs, longest[m]),
            )
            batch.token_weights[rows] = loss_weights(kept[rows], "token_mean", totals=(tokens, seqs, longest[m]))

    def _m2po_mask(self, log_ratio: torch.Tensor, mask: torch.Tensor, per_rank: int) -> torch.Tensor:
        """M2PO's mask of this rank's rows, taken over each whole mini-batch: every rank's rows of it are gathered
        (a sum of zero-padded copies), so the tokens dropped do not depend on the data-parallel split."""
        dp, rank = self.env.dp_size, self.env.dp_rank
        shared = torch.zeros(2, dp, *mask.shape, dtype=torch.float64)
        shared[0, rank], shared[1, rank] = log_ratio.double() * mask, mask.double()
        ratios, masks = self.env.all_reduce_sum(shared).unbind()
        kept = torch.empty_like(mask)
        for start in range(0, mask.shape[0], per_rank):
            rows = slice(start, start + per_rank)
            step_kept = m2po_mask(ratios[:, rows].flatten(0, 1), masks[:, rows].flatten(0, 1), self.algo.m2_threshold)
            kept[rows] = step_kept.view(dp, -1, mask.shape[1])[rank].to(mask.dtype)
        return kept

    def _local_rows(self, steps: int, per_step: int) -> torch.Tensor:
        """Indices of this rank's rows: its data-parallel group's contiguous share of every mini-batch."""
        per_rank = per_step // self.env.dp_size
        starts = [m * per_step + self.env.dp_rank * per_rank for m in range(steps)]
        return torch.cat([torch.arange(start, start + per_rank) for start in starts])

    @torch.no_grad()
    def _recompute(self, batch: TrainBatch) -> None:
        """Forward-only passes before the update: proximal logprobs, critic values, reference logprobs."""
        needs_policy = (self.algo.recomputes_logprobs and not self.proximal_in_step) or self.algo.name == "ppo"
        needs_reference = self.algo.needs_reference and batch.ref_logprobs is None
        if needs_reference and self.reference is None:
            raise ValueError(
                f"algorithm {self.algo.name} (kl_coef={self.algo.kl_coef}) needs reference logprobs: the samples "
                "carry no ref_logprobs and ref_model_path is not set"
            )
        if needs_policy:
            batch.old_logprobs = torch.zeros_like(batch.loss_mask)
            batch.old_values = torch.zeros_like(batch.loss_mask) if self.algo.name == "ppo" else None
        if needs_reference:
            batch.ref_logprobs = torch.zeros_like(batch.loss_mask)
        if not (needs_policy or needs_reference):
            return
        for rows, micro in self._micro_batches(batch):
            width = micro.input_ids.shape[1] - 1
            if needs_policy:
                with self._autocast():
                    out = self._forward(self.policy, micro)
                batch.old_logprobs[rows, :width] = _masked(out.logprobs, micro)
                if out.values is not None:
                    batch.old_values[rows, :width] = _masked(out.values, micro)
            if needs_reference:
                with self._autocast():
                    out = self._forward(self.reference, micro, entropy=False)
                batch.ref_logprobs[rows, :width] = _masked(out.logprobs, micro)

    def _forward(self, model: PolicyModel, micro: TrainBatch, entropy_grad: bool = False,
                 entropy: bool = True) -> PolicyOutput:
        return run_policy(model, micro.input_ids, micro.attention_mask, self._temperatures(micro), entropy_grad,
                          packing=self.packing, entropy=entropy, images=micro.images)

    def _temperatures(self, batch: TrainBatch) -> torch.Tensor | None:
        """RL objectives score the sampled tokens under the distribution they were drawn from (logits / T);
        SFT and DPO score their data under the model itself (T = 1)."""
        return batch.temperatures if self.algo.name in ("grpo", "ppo", "distill") else None

    def _trained_mask(self, batch: TrainBatch) -> torch.Tensor:
        """The loss mask before rejection (the KL penalty and importance weights are taken on it, as verl's)."""
        return batch.loss_mask if batch.rejected is None else batch.loss_mask + batch.rejected

    def _kl_in_reward(self, batch: TrainBatch, token_rewards: torch.Tensor) -> torch.Tensor:
        """Token rewards minus kl_reward_coef * KL(policy before the update || reference) on every trained token."""
        if self.algo.kl_reward_coef == 0:
            return token_rewards
        before = batch.old_logprobs if batch.old_logprobs is not None else batch.rollout_logprobs
        return kl_reward_penalty(token_rewards, before, batch.ref_logprobs, self._trained_mask(batch),
                                 self.algo.kl_reward_coef, self.algo.kl_reward_estimator)

    def _sequence_advantages(self, local: TrainBatch, batch: TrainBatch, real: torch.Tensor, rows: torch.Tensor) -> None:
        """grpo / rloo / reinforce_plus_plus_baseline: one advantage per sequence from the real rows of the whole
        pulled batch (groups may span ranks), each sequence's score its reward minus its KL penalty sum."""
        scores = batch.rewards.double()
        if self.algo.kl_reward_coef > 0:
            penalties = torch.zeros_like(scores)
            penalties[rows] = -self._kl_in_reward(local, torch.zeros_like(local.loss_mask)).double().sum(-1)
            scores = scores - self.env.all_reduce_sum(penalties)
        advantages = torch.zeros_like(scores)
        advantages[real] = sequence_advantages(
            self.algo.advantage_estimator, scores[real], batch.group_index[real], self.algo.grpo_norm_std,
            self.algo.grpo_eps, self.algo.grpo_group_of_one,
        )
        local.advantages = advantages[rows].to(local.rewards.dtype)[:, None] * local.loss_mask
        if self.algo.advantage_estimator == "reinforce_plus_plus_baseline":
            local.advantages = self._whiten(local.advantages, local.loss_mask)

    def _token_advantages(self, batch: TrainBatch) -> None:
        """PPO: GAE on the critic's values; REINFORCE++: discounted returns. Whitened over the whole pulled batch
        (all ranks); the sequence's reward sits on its last trained (kept) token."""
        token_rewards = self._kl_in_reward(batch, terminal_rewards(batch.rewards, batch.loss_mask))
        if self.algo.advantage_estimator == "gae":
            advantages, batch.returns = gae(token_rewards, batch.old_values, batch.loss_mask, self.algo.gamma, self.algo.lam)
            batch.advantages = self._whiten(advantages, batch.loss_mask) if self.algo.whiten_advantages else advantages
            return
        returns = discounted_returns(token_rewards, batch.loss_mask, self.algo.gamma, self.algo.steps_over_masked)
        batch.advantages = self._whiten(returns, batch.loss_mask)

    def _whiten(self, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return whiten(values, mask, self.env.all_reduce_sum(masked_moments(values, mask)))

    def _set_off_policy_correction(self, batch: TrainBatch) -> None:
        """The policy the ratio is taken against, and importance weights for asynchronous data (docs/algorithms.md).

        Weights are taken on the mask before rejection and batch-normalised over it (verl's order), then
        rejected tokens weigh 0. bypass's weights and rejection are the objective's (current policy)."""
        if self.algo.off_policy in ("none", "bypass"):
            batch.old_logprobs = batch.rollout_logprobs
            return
        if self.algo.off_policy == "recompute":
            return
        mask = self._trained_mask(batch)
        weights = tis_weights if self.algo.off_policy == "tis" else decoupled_weights
        is_weights = weights(batch.old_logprobs, batch.rollout_logprobs, self.algo.is_cap, mask, self.algo.is_level)
        if self.algo.is_batch_normalize:
            moments = self.env.all_reduce_sum(is_weight_moments(is_weights, mask, self.algo.is_level))
            is_weights = normalize_is_weights(is_weights, moments)
        batch.is_weights = is_weights * batch.loss_mask

    # -- one optimizer step -------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, step: int, version: int = 0) -> dict[str, float]:
        """Forward/backward every micro-batch, clip, step. Metrics are summed over all ranks; RL objectives also
        report how far the rollout's logprobs are from the trainer's (trainer/mismatch.py), by lag to `version`."""
        lr = self._set_learning_rate(step)
        micro_batches = list(self._micro_batches(batch))
        sums: dict[str, torch.Tensor] = {}
        largest_mismatch = torch.zeros((), dtype=torch.float64)
        measures_mismatch = self.algo.name in ("grpo", "ppo", "distill")
        for index, (_, micro) in enumerate(micro_batches):
            self._sync_gradients(index == len(micro_batches) - 1)
            with self._autocast():
                out = self._forward(self.policy, micro, entropy_grad=self.algo.entropy_coef > 0)
            if self.proximal_in_step:
                micro.old_logprobs = out.logprobs.detach() * micro.loss_mask
                self._set_off_policy_correction(micro)
            loss, metrics = objective(self.algo, micro, out)
            # FSDP averages gradients over the data-parallel ranks; every one's loss is its share of the global sum.
            (loss * self.env.dp_size).backward()
            metrics["tokens"] = micro.loss_mask.sum()
            if measures_mismatch:
                mismatch, largest = mismatch_sums(out.logprobs, micro.rollout_logprobs, self._trained_mask(micro),
                                                  micro.versions[:, : out.logprobs.shape[1]], version)
                metrics.update(mismatch)
                largest_mismatch = torch.maximum(largest_mismatch, largest.detach().double().cpu())
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value.detach().double().cpu()
        grad_norm = self._clip_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sums["samples"] = (batch.row_weights > 0).sum().double()  # padding rows weigh 0
        names = sorted(sums)
        totals = self.env.all_reduce_sum(torch.stack([sums[name] for name in names]))
        result = dict(zip(names, totals.tolist(), strict=True))
        result.update(mismatch_metrics(result, largest_over_ranks(self.env, largest_mismatch)))
        result.update(grad_norm=grad_norm, lr=lr, **self.batch_metrics)
        return result

    def _micro_batches(self, batch: TrainBatch) -> Iterator[tuple[slice | torch.Tensor, TrainBatch]]:
        """This rank's micro-batches (collective with a token budget: every rank runs the same number)."""
        for rows in self._micro_rows(batch):
            yield rows, batch.select(rows).trimmed().to(self.env.device)

    def _micro_rows(self, batch: TrainBatch) -> list[slice | torch.Tensor]:
        cfg = self.config.batch
        if cfg.max_tokens_per_micro_batch is None:
            size = cfg.micro_batch_size
            return [slice(start, start + size) for start in range(0, batch.num_rows, size)]
        unit = 2 if self.algo.name == "dpo" else 1  # a (chosen, rejected) pair stays in one micro-batch
        per_unit = batch.attention_mask.sum(-1).view(-1, unit)
        max_units = max(1, cfg.micro_batch_size // unit)
        if cfg.packing:  # the budget counts real tokens: packed rows hold no padding
            lengths = per_unit.sum(-1).tolist()
            packs = pack_by_token_sum(lengths, cfg.max_tokens_per_micro_batch, max_units)
        else:
            lengths = per_unit.amax(-1).tolist()
            packs = pack_by_tokens(lengths, cfg.max_tokens_per_micro_batch // unit, max_units)
        packs = split_packs(packs, lengths, self.env.all_reduce_max(len(packs)), packed=cfg.packing)
        return [torch.tensor([u * unit + j for u in pack for j in range(unit)], dtype=torch.int64) for pack in packs]

    def _set_learning_rate(self, step: int) -> float:
        optim = self.config.optim
        lr = optim.lr * min(1.0, (step + 1) / optim.warmup_steps) if optim.warmup_steps else optim.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _sync_gradients(self, is_last_micro_batch: bool) -> None:
        # Reduce-scatter gradients once per step, after the last micro-batch.
        if isinstance(self.policy, FSDPModule):
            self.policy.set_requires_gradient_sync(is_last_micro_batch)

    def _clip_gradients(self) -> float:
        max_norm = self.config.optim.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_norm if max_norm is not None else float("inf"))
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def _autocast(self) -> contextlib.AbstractContextManager:
        fsdp_casts = self.env.distributed and self.config.parallel.mixed_precision  # trainer/parallel/fsdp.py
        return contextlib.nullcontext() if fsdp_casts else autocast(self.env.device, self.config.dtype)


def _masked(per_token: torch.Tensor, micro: TrainBatch) -> torch.Tensor:
    """A forward's per-token output on the loss mask, as the batch's float32 CPU fields hold it."""
    return (per_token * micro.loss_mask).to("cpu", micro.loss_mask.dtype)
