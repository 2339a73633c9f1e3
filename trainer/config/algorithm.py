"""The `algorithm:` section of the trainer config: what is optimised, its loss and its off-policy correction."""

from typing import Literal

from pydantic import Field, model_validator

from services.config import Strict

AlgorithmName = Literal["sft", "dpo", "ppo", "grpo", "distill"]
LossAgg = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"]

# Each algorithm's usual loss aggregation when `loss_agg` is not set.
DEFAULT_LOSS_AGG: dict[str, LossAgg] = {
    "sft": "token_mean",
    "dpo": "token_mean",  # unused: DPO averages over pairs
    "ppo": "token_mean",
    "grpo": "seq_mean_token_mean",
    "distill": "token_mean",
}


RejectionStatistic = Literal[
    "token_k1", "token_k2", "token_k3",
    "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3",
    "seq_max_k2", "seq_max_k3",
]  # fmt: skip


class RejectionRule(Strict):
    """One rejection criterion of off-policy correction (verl's rollout_rs option and its threshold)."""

    statistic: RejectionStatistic = Field(
        description="Divergence statistic between the trainer's policy and the rollout's, per token (token_*) or per "
        "sequence (seq_sum/seq_mean/seq_max of the token statistic); k1 = log(pi_rollout / pi_trainer), "
        "k2 = k1^2 / 2, k3 = exp(-k1) - 1 + k1. A token (token_*) or whole sequence (seq_*) out of bounds is "
        "masked out of the loss."
    )
    upper: float = Field(
        gt=0,
        description="k2/k3: kept while the statistic <= upper. k1: kept while lower <= pi_rollout / pi_trainer <= "
        "upper (the ratio, not its log; e.g. 2.0).",
    )
    lower: float | None = Field(None, gt=0, description="k1 only: lower bound of the ratio; None = 1 / upper.")

    @model_validator(mode="after")
    def _check(self) -> "RejectionRule":
        if self.lower is not None and not self.statistic.endswith("k1"):
            raise ValueError(f"rejection {self.statistic}: lower applies to k1 statistics only")
        if self.statistic.endswith("k1") and (self.lower if self.lower is not None else 1 / self.upper) > self.upper:
            raise ValueError(f"rejection {self.statistic}: lower must not exceed upper")
        return self


# Named sets of rejection rules (`rejection: <name>`). IcePop (Ling team, Ring-1T): a token's gradient is dropped when its
# train/inference probability ratio pi_trainer / pi_rollout leaves [0.5, 5], i.e. pi_rollout / pi_trainer outside
# [0.2, 2]; with `off_policy: recompute` the trainer's side is the policy before the update.
REJECTION_PRESETS: dict[str, list[dict]] = {"icepop": [{"statistic": "token_k1", "lower": 0.2, "upper": 2.0}]}


class AlgorithmConfig(Strict):
    """What is optimised. RLVR is `grpo` or `ppo` fed by verifiable rewards (the reward service).

    Every family's configuration is in docs/algorithms.md. Common variants: Dr. GRPO = `grpo_norm_std: false,
    loss_agg: seq_mean_token_sum_norm`; DAPO = `loss_agg: token_mean, clip_eps_high: 0.28, dynamic_sampling: true`;
    GSPO = `policy_loss: gspo` (aggregated by seq_mean_token_mean unless loss_agg says otherwise, as SAPO);
    CISPO = `policy_loss: cispo, clip_eps_high: ...`; RLOO / REINFORCE++ = `advantage_estimator: ...`.
    Defaults follow verl (trainer/ppo/core_algos.py) and TRL (DPOTrainer); tests/test_reference_*.py checks them.
    """

    name: AlgorithmName = Field("grpo", description="sft, dpo, ppo (with a value head), grpo, distill (on-policy).")
    loss_agg: LossAgg | None = Field(
        None,
        description="How per-token losses become one number: token_mean (DAPO), seq_mean_token_mean (GRPO), "
        "seq_mean_token_sum_norm (Dr. GRPO: the token sum over a constant), seq_mean_token_sum. "
        "None = the algorithm's default.",
    )
    loss_norm_length: int | None = Field(
        None,
        gt=0,
        description="The constant of seq_mean_token_sum_norm (verl: the maximum response length); None = longest in batch.",
    )
    loss_norm_seqs: bool = Field(
        False,
        description="seq_mean_token_sum_norm: also divide by the number of sequences (the Dr. GRPO paper's 1/G); "
        "verl does not.",
    )
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo", "reinforce"] = Field(
        "ppo",
        description="grpo/ppo policy term, as verl's: ppo = clipped token ratio (+ dual clip); gspo = clipped "
        "sequence ratio (geometric mean of the token ratios); cispo = clipped, detached ratio times log p; sapo = "
        "smooth gate on the ratio (sapo_tau_pos/neg); reinforce = -A log p (no ratio; is_weights still apply).",
    )
    sapo_tau_pos: float = Field(1.0, gt=0, description="SAPO: gate temperature where the advantage is positive.")
    sapo_tau_neg: float = Field(1.05, gt=0, description="SAPO: gate temperature elsewhere (verl's default 1.05).")
    clip_eps_low: float = Field(0.2, ge=0, description="PPO/GRPO ratio clip below: 1 - eps_low.")
    clip_eps_high: float = Field(0.2, ge=0, description="PPO/GRPO ratio clip above: 1 + eps_high (DAPO uses 0.28).")
    clip_ratio_c: float | None = Field(
        3.0,
        gt=1,
        description="Dual clip (policy_loss ppo): a token with negative advantage loses at most -A * clip_ratio_c "
        "(verl's default 3); None = off.",
    )
    grpo_norm_std: bool = Field(True, description="GRPO: divide group-centred rewards by the group std (False = Dr. GRPO).")
    grpo_eps: float = Field(1e-6, gt=0, description="GRPO: added to the group std.")
    grpo_group_of_one: Literal["score", "zero"] = Field(
        "score",
        description="GRPO: advantage of a group of one sample. score = its reward over std 1 (verl); zero = 0.",
    )
    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"] | None = (
        Field(
            None,
            description="How rewards become advantages (verl's adv_estimator). name grpo (critic-free): grpo = group-"
            "normalised rewards; rloo = reward minus the mean of the others in its group; reinforce_plus_plus = "
            "discounted returns (gamma) whitened over the batch; reinforce_plus_plus_baseline = group-centred rewards "
            "whitened over the batch. name ppo: gae (the only one). None = grpo for grpo, gae for ppo.",
        )
    )
    steps_over_masked: bool = Field(
        False,
        description="reinforce_plus_plus: the running return steps over masked-out tokens (environment tokens of a "
        "multi-turn sample) instead of restarting there, as verl does.",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO dynamic sampling, trainer side: drop every group (of two or more samples) whose rewards "
        "are all equal before training; counted in the step metrics (dropped_groups, dropped_samples and their "
        "running totals). The batch trains smaller (verl's DAPO generates more groups to fill it); dropped samples "
        "are acked with the batch. grpo only.",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="PPO (GAE) and REINFORCE++: discount.")
    lam: float = Field(0.95, ge=0, le=1, description="PPO: GAE lambda.")
    value_clip_eps: float = Field(0.2, ge=0, description="PPO: value clip range around the old values.")
    value_coef: float = Field(0.5, ge=0, description="PPO: weight of the value loss.")
    whiten_advantages: bool = Field(
        True, description="PPO: normalise GAE advantages over the batch (mean 0, unbiased variance 1, as verl)."
    )
    dpo_beta: float = Field(0.1, gt=0, description="DPO: inverse temperature of the implicit reward.")
    dpo_loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid",
        description="DPO loss as TRL's: sigmoid (DPO), hinge (SLiC), ipo (squared, on length-normalised log-ratios).",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="Weight of KL(policy || reference) in the loss (verl's use_kl_loss); 0 = off."
    )
    kl_estimator: Literal["k1", "k2", "k3", "abs"] = Field(
        "k3",
        description="Per-token KL estimator (as verl's kl_penalty): k1 = log p - log q, abs = |k1|, k2 = k1^2 / 2, "
        "k3 = q/p - log(q/p) - 1 clamped to 10 (verl's low_var_kl, its default for a KL loss).",
    )
    kl_reward_coef: float = Field(
        0.0,
        ge=0,
        description="KL to the reference as a reward penalty (verl's use_kl_in_reward, fixed coefficient): every "
        "trained token's reward minus kl_reward_coef * KL estimate, before advantages (grpo/rloo/"
        "reinforce_plus_plus_baseline see the sequence's reward minus coef * its KL sum). KL of the policy before "
        "the update (recomputed logprobs when off_policy recomputes, else the rollout's). 0 = off. ppo and grpo.",
    )
    kl_reward_estimator: Literal["k1", "k2", "k3", "abs"] = Field(
        "k1", description="Estimator of the KL reward penalty (see kl_estimator); k1 is verl's default kl_penalty."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus (subtracted from the loss).")
    off_policy: Literal["none", "tis", "decoupled", "recompute", "bypass"] = Field(
        "none",
        description="Correction for asynchronous data / engine-trainer mismatch (docs/algorithms.md). none: the ratio "
        "is taken against the rollout logprobs, no weights. tis: ratio against the trainer's logprobs recomputed "
        "before the update (pi_prox), times min(pi_prox/pi_rollout, is_cap) (truncated IS; verl's decoupled mode "
        "with rollout_is). decoupled: same ratio, times pi_prox/pi_rollout with weights above is_cap dropped "
        "(masked IS, AReaL). recompute: ratio against pi_prox, no weights (with rejection: verl's decoupled "
        "rejection-only modes). bypass: no recompute, ratio against the rollout logprobs (verl's bypass mode); "
        "weights min(pi/pi_rollout, is_cap) of the current policy apply to policy_loss reinforce only (a ratio loss "
        "is its own correction), rejection is taken on the current policy.",
    )
    is_cap: float = Field(
        2.0, gt=0, description="Cap of the importance weight (tis, decoupled, bypass): verl's rollout_is_threshold."
    )
    is_level: Literal["token", "sequence"] = Field(
        "token",
        description="Importance weights per token, or one per sequence: the product of its token ratios, capped "
        "(tis, bypass) or the sequence dropped above the cap (decoupled).",
    )
    is_batch_normalize: bool = Field(
        False,
        description="Divide the importance weights by their mean over the pulled batch (all ranks; per token or per "
        "sequence as is_level), so they average 1 (verl's rollout_is_batch_normalize). tis and decoupled.",
    )
    rejection: list[RejectionRule] = Field(
        default_factory=list,
        description="Rejection sampling (verl's rollout_rs, chained): tokens or sequences whose divergence from the "
        "rollout policy is out of bounds are masked out of the loss, the advantages and the normalisation (tis, "
        "decoupled, recompute: on pi_prox, counts summed over ranks per mini-batch; bypass: on the current policy "
        "per micro-batch, out of the loss but still in its normalisation). Counted as metric rejected_tokens. "
        "A name instead of a list: a preset (icepop = token_k1 with lower 0.2, upper 2.0: pi_trainer / pi_rollout "
        "kept within [0.5, 5]).",
    )
    m2_threshold: float | None = Field(
        None,
        gt=0,
        description="M2PO (second-moment trust region, arXiv 2510.01161): over each mini-batch's trained tokens (all "
        "ranks), the tokens of largest (log pi_prox - log pi_rollout)^2 are masked out of the loss, the advantages "
        "and the normalisation until the mean of the rest is below this (the paper's 0.04). Needs off_policy tis, "
        "decoupled or recompute; the policy loss and its clipping stay as configured. Counted in rejected_tokens.",
    )

    @model_validator(mode="before")
    @classmethod
    def _rejection_preset(cls, data):
        if isinstance(data, dict) and isinstance(data.get("rejection"), str):
            name = data["rejection"]
            if name not in REJECTION_PRESETS:
                raise ValueError(f"rejection: unknown preset {name!r} (presets: {', '.join(REJECTION_PRESETS)})")
            data = {**data, "rejection": REJECTION_PRESETS[name]}
        return data

    @model_validator(mode="after")
    def _fill_defaults(self) -> "AlgorithmConfig":
        if self.loss_agg is None:
            # verl aggregates GSPO and SAPO by seq-mean-token-mean whatever its loss_agg_mode; here it is the default.
            sequence_mean = self.policy_loss in ("gspo", "sapo") and self.name in ("grpo", "ppo")
            self.loss_agg = "seq_mean_token_mean" if sequence_mean else DEFAULT_LOSS_AGG[self.name]
        if self.advantage_estimator is None and self.name in ("grpo", "ppo"):
            self.advantage_estimator = "gae" if self.name == "ppo" else "grpo"
        if self.name == "ppo" and self.advantage_estimator != "gae":
            raise ValueError("advantage_estimator: ppo estimates advantages by gae (use name grpo for the others)")
        if self.name == "grpo" and self.advantage_estimator == "gae":
            raise ValueError("advantage_estimator: gae needs a critic (name ppo)")
        if self.dynamic_sampling and self.name != "grpo":
            raise ValueError("dynamic_sampling: grpo only (it drops groups of equal rewards)")
        if self.kl_reward_coef > 0 and self.name not in ("grpo", "ppo"):
            raise ValueError("kl_reward_coef: a reward penalty needs an RL algorithm (grpo, ppo)")
        if self.off_policy == "bypass" and self.name not in ("grpo", "ppo"):
            raise ValueError("off_policy bypass: grpo and ppo only")
        if self.rejection and self.off_policy == "none":
            raise ValueError("rejection: needs off_policy tis, decoupled, recompute or bypass (a policy to compare)")
        if self.m2_threshold is not None and not self.recomputes_logprobs:
            raise ValueError("m2_threshold: M2PO needs off_policy tis, decoupled or recompute (pi_prox vs the rollout)")
        if self.is_batch_normalize and self.off_policy not in ("tis", "decoupled"):
            raise ValueError("is_batch_normalize: off_policy tis or decoupled (weights taken before the update)")
        return self

    @property
    def needs_reference(self) -> bool:
        """Whether reference (or teacher) logprobs are needed: DPO, distillation, a KL term or penalty."""
        return self.name in ("dpo", "distill") or self.kl_coef > 0 or self.kl_reward_coef > 0

    @property
    def recomputes_logprobs(self) -> bool:
        """Whether the trainer recomputes the policy's logprobs before the update (the proximal policy)."""
        return self.name in ("ppo", "grpo", "distill") and self.off_policy in ("tis", "decoupled", "recompute")
