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
    local_rows,
    micro_batch_rows,
    order_preference_pairs,
    pad_rows,
    plan_mini_batches,
)
from trainer.config import TrainerConfig
from trainer.lora import adapter_disabled
from trainer.losses import loss_totals, loss_weights
from trainer.mismatch import largest_over_ranks, mismatch_metrics, mismatch_sums
from trainer.model import Packing, PolicyModel, PolicyOutput, run_policy
from trainer.moe.metrics import MoeStats
from trainer.moe.routing import check_routes
from trainer.objectives import objective
from trainer.off_policy import reject, set_off_policy_correction
from trainer.parallel import DistEnv, build_policy
from trainer.parallel.ep import clip_grad_norm
from trainer.parallel.fsdp import uses_fsdp
from trainer.parallel.pipeline import Pipeline
from trainer.stages import StageClock
from trainer.varlen import use_varlen


class Learner:
    """Owns the (sharded) policy, the frozen reference if any, and the optimizer."""

    def __init__(self, config: TrainerConfig, env: DistEnv) -> None:
        parallel = config.parallel
        if (parallel.tp, parallel.pp, parallel.ep) != (env.tp_size, env.pp_size, env.ep_size):
            raise ValueError(f"parallel.tp={parallel.tp}, pp={parallel.pp}, ep={parallel.ep}, but the process group "
                             f"was made with tp={env.tp_size}, pp={env.pp_size}, ep={env.ep_size}")
        config.batch.check_divisible(env.dp_size)
        self.config = config
        self.algo = config.algorithm
        self.env = env
        torch.manual_seed(config.seed)
        self.policy: PolicyModel = build_policy(config.model_path, env, config.parallel, config.model,
                                                value_head=self.algo.name == "ppo", dtype=config.dtype, seed=config.seed)
        self.pad_id = self.policy.lm.config.pad_token_id or 0
        self.packing = Packing(config.batch.pack_row_tokens, self.pad_id) if config.batch.packing else None
        self.reference: PolicyModel | None = None
        # LoRA: the reference is the policy itself with its adapters off (no second model), unless a different one
        # (a distillation teacher) is named.
        self.adapter_reference = config.model.lora is not None and config.ref_model_path in (None, config.model_path)
        if config.ref_model_path is not None and self.algo.needs_reference and not self.adapter_reference:
            self.reference = build_policy(config.ref_model_path, env, config.parallel, config.model, trainable=False,
                                          dtype=config.dtype)
        if env.pp_size > 1 and self.policy.router_hooks is not None:
            raise ValueError("parallel.pp > 1: a mixture-of-experts policy's routing replay and router metrics run on "
                             "one stage's hooks; pipeline stages do not carry them yet (use pp 1)")
        self.pipelines = {id(model): Pipeline(model, env, config.parallel, self.pad_id, config.dtype)  # pp > 1
                          for model in filter(None, (self.policy, self.reference)) if env.pp_size > 1}
        self.pipeline = self.pipelines.get(id(self.policy))
        if self.packing is not None and config.batch.packed_attention == "varlen":
            for model in filter(None, (self.policy, self.reference)):
                use_varlen(model.lm)
        # One optimizer step per pulled batch: the proximal policy is the one the step starts from, so its
        # logprobs are the training forward's, detached (verl's on_policy path), not a second forward pass. Not
        # when something needs them before the step: rejection, M2PO or batch-normalised weights (whole mini-batch),
        # a KL reward penalty (advantages), PPO's values.
        algo = self.algo
        self.proximal_in_step = (algo.recomputes_logprobs and algo.name != "ppo" and config.batch.mini_batches == 1
                                 and not algo.rejection and algo.m2_threshold is None and not algo.is_batch_normalize
                                 and algo.kl_reward_coef == 0)
        # Routing replay (R3): a mixture-of-experts policy runs the experts the rollout routed each token to
        self.replays_routes = config.moe.routing_replay == "rollout" and self.policy.router_hooks is not None
        optim = config.optim
        self.stages = StageClock(env.device, self.policy.lm, env.tp_size)  # this rank's time by stage, its FLOPs
        # Dynamic sampling's counts: the last pulled batch's (added to each of its steps' metrics) and running totals.
        self.batch_metrics: dict[str, float] = {}
        self.dropped_totals = {"dropped_groups_total": 0.0, "dropped_samples_total": 0.0}
        # The fused kernel: one pass over each parameter instead of a dozen ops (~1 ms of the quickstart's 27 ms
        # step on one CPU thread); the same update up to float rounding.
        trainable = [p for p in self.policy.parameters() if p.requires_grad]  # LoRA: the adapters (+ value head)
        self.optimizer = torch.optim.AdamW(
            trainable, lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay,
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
        if self.replays_routes:
            check_routes(samples)
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
            reject(local, self.algo, self.env, per_step // self.env.dp_size, longest)
        if self.algo.advantage_estimator in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
            self._sequence_advantages(local, batch, real, rows)
        elif self.algo.advantage_estimator is not None:
            self._token_advantages(local)
        if self.algo.name in ("grpo", "ppo", "distill") and not self.proximal_in_step:
            set_off_policy_correction(local, self.algo, self.env, self._trained_mask(local))
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

    def _local_rows(self, steps: int, per_step: int) -> torch.Tensor:
        return local_rows(steps, per_step, self.env.dp_size, self.env.dp_rank)

    @torch.no_grad()
    def _recompute(self, batch: TrainBatch) -> None:
        """Forward-only passes before the update: proximal logprobs, critic values, reference logprobs."""
        needs_policy = (self.algo.recomputes_logprobs and not self.proximal_in_step) or self.algo.name == "ppo"
        needs_reference = self.algo.needs_reference and batch.ref_logprobs is None
        if needs_reference and self.reference is None and not self.adapter_reference:
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
        micro_batches = list(self._micro_batches(batch))
        if needs_policy:
            for (rows, micro), out in self._forward_all(self.policy, micro_batches):
                width = micro.input_ids.shape[1] - 1
                batch.old_logprobs[rows, :width] = _masked(out.logprobs, micro)
                if out.values is not None:
                    batch.old_values[rows, :width] = _masked(out.values, micro)
        if needs_reference:
            with self._reference_model() as reference:
                for (rows, micro), out in self._forward_all(reference, micro_batches, entropy=False):
                    batch.ref_logprobs[rows, :micro.input_ids.shape[1] - 1] = _masked(out.logprobs, micro)
        if self.pipeline is not None:  # the last stage's figures on every stage
            self.pipeline.share(batch.old_logprobs, batch.old_values, batch.ref_logprobs)

    def _forward_all(self, model: PolicyModel, micro_batches: list, entropy: bool = True):
        """(micro-batch, its forward's output) of each micro-batch (with stages: on the last stage only)."""
        with self._autocast():
            if id(model) in self.pipelines:
                yield from zip(micro_batches, self.pipelines[id(model)].run(micro_batches, self._temperatures,
                                                                            entropy=entropy) or [])
            else:
                yield from (((rows, micro), self._forward(model, micro, entropy=entropy)) for rows, micro in micro_batches)

    def _reference_model(self) -> contextlib.AbstractContextManager[PolicyModel]:
        """The reference policy: its own model, or (LoRA) the policy with its adapters off while in the block."""
        if self.adapter_reference:
            return adapter_disabled(self.policy)
        return contextlib.nullcontext(self.reference)

    def _forward(self, model: PolicyModel, micro: TrainBatch, entropy_grad: bool = False,
                 entropy: bool = True) -> PolicyOutput:
        real = micro.attention_mask
        if micro.row_weights is not None:  # a padding row (a copy of a real one) counts in no routing metric
            real = real * (micro.row_weights > 0)[:, None]
        return run_policy(model, micro.input_ids, micro.attention_mask, self._temperatures(micro), entropy_grad,
                          packing=self.packing, entropy=entropy, routes=micro.routed_experts,
                          replay=self.replays_routes and model is self.policy, token_mask=real, images=micro.images)

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

    # -- one optimizer step -------------------------------------------------------------------

    def train_step(self, batch: TrainBatch, step: int, version: int = 0) -> dict[str, float]:
        """Forward/backward every micro-batch, clip, step. Metrics are summed over all ranks; RL objectives also
        report how far the rollout's logprobs are from the trainer's (trainer/mismatch.py), by lag to `version`."""
        lr = self._set_learning_rate(step)
        micro_batches = list(self._micro_batches(batch))
        sums: dict[str, torch.Tensor] = {}
        largest_mismatch = torch.zeros((), dtype=torch.float64)
        measures_mismatch = self.algo.name in ("grpo", "ppo", "distill")
        moe = MoeStats(self.policy.router_hooks) if self.policy.router_hooks is not None else None

        def micro_loss(index: int, out: PolicyOutput) -> torch.Tensor:
            nonlocal largest_mismatch
            micro = micro_batches[index][1]
            if self.proximal_in_step:
                micro.old_logprobs = out.logprobs.detach() * micro.loss_mask
                set_off_policy_correction(micro, self.algo, self.env, self._trained_mask(micro))
            loss, metrics = objective(self.algo, micro, out)
            if moe is not None:  # the load-balancing loss, its mean over micro-batches and ranks (trainer/moe/metrics.py)
                loss = loss + self.config.moe.aux_loss_coef / (len(micro_batches) * self.env.dp_size) * moe.add()
            metrics["tokens"] = micro.loss_mask.sum()
            if measures_mismatch:
                mismatch, largest = mismatch_sums(out.logprobs, micro.rollout_logprobs, self._trained_mask(micro),
                                                  micro.versions[:, : out.logprobs.shape[1]], version)
                metrics.update(mismatch)
                largest_mismatch = torch.maximum(largest_mismatch, largest.detach().double().cpu())
            for name, value in metrics.items():
                sums[name] = sums.get(name, 0.0) + value.detach().double().cpu()
            # FSDP averages gradients over the data-parallel ranks; every one's loss is its share of the global sum.
            return loss * self.env.dp_size

        entropy_grad = self.algo.entropy_coef > 0
        if self.pipeline is not None:  # the losses on the last stage; its sums to every stage
            with self._autocast():
                self.pipeline.run(micro_batches, self._temperatures, micro_loss, entropy_grad=entropy_grad)
            sums = self.pipeline.from_last(sums)
        for index, (_, micro) in enumerate(micro_batches if self.pipeline is None else []):
            self._sync_gradients(index == len(micro_batches) - 1)
            with self._autocast():
                out = self._forward(self.policy, micro, entropy_grad=entropy_grad)
            self.stages.backward(micro_loss(index, out), micro.input_ids.shape, micro.attention_mask)
        grad_norm = self.stages.optimizer_step(self.optimizer, self._clip_gradients)
        sums["samples"] = (batch.row_weights > 0).sum().double()  # padding rows weigh 0
        names = sorted(sums)
        totals = self.env.all_reduce_sum(torch.stack([sums[name] for name in names]))
        result = dict(zip(names, totals.tolist(), strict=True))
        result.update(mismatch_metrics(result, largest_over_ranks(self.env, largest_mismatch)))
        result.update(grad_norm=grad_norm, lr=lr, **self.batch_metrics)
        if moe is not None:
            result.update(moe.finish(self.env))
        if self.pipeline is not None:
            result.update(self.pipeline.step_metrics())
        return result

    def _micro_batches(self, batch: TrainBatch) -> Iterator[tuple[slice | torch.Tensor, TrainBatch]]:
        """This rank's micro-batches (collective with a token budget: every rank runs the same number)."""
        for rows in self._micro_rows(batch):
            yield rows, batch.select(rows).trimmed().to(self.env.device)

    def _micro_rows(self, batch: TrainBatch) -> list[slice | torch.Tensor]:
        unit = 2 if self.algo.name == "dpo" else 1  # a (chosen, rejected) pair stays in one micro-batch
        return micro_batch_rows(batch, self.config.batch, unit, self.env.all_reduce_max)

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
        if self.pipeline is not None:
            return self.pipeline.clip_gradients(max_norm)
        return clip_grad_norm(self.policy.parameters(), max_norm if max_norm is not None else float("inf"))

    def _autocast(self) -> contextlib.AbstractContextManager:
        fsdp_casts = uses_fsdp(self.env) and self.config.parallel.mixed_precision  # trainer/parallel/fsdp.py
        return contextlib.nullcontext() if fsdp_casts else autocast(self.env.device, self.config.dtype)


def _masked(per_token: torch.Tensor, micro: TrainBatch) -> torch.Tensor:
    """A forward's per-token output on the loss mask, as the batch's float32 CPU fields hold it."""
    return (per_token * micro.loss_mask).to("cpu", micro.loss_mask.dtype)
