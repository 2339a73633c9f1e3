"""Compute the expected numbers of tests/test_reference_*.py by running the reference implementations.

Not run in CI: it needs git checkouts of the references (any clone or bare mirror), e.g.

    git clone https://github.com/volcengine/verl /tmp/verl
    git clone https://github.com/huggingface/trl /tmp/trl
    .venv/bin/python tests/data/reference/generate.py --verl /tmp/verl --trl /tmp/trl

It reads the reference source at a given commit (default: HEAD) with `git show`, extracts the functions
it needs with `ast` (verl's core_algos.py, rollout_corr_helper.py, torch_functional.py and
ray_trainer.apply_kl_penalty; the loss section of TRL's DPOTrainer._compute_loss), executes them as they
are (they are pure torch; only verl's config objects and DataProto are stood in for by small shims),
and writes the inputs and outputs, float64, to verl.json and trl_dpo.json beside this file. The
commit sha of each reference is stored in the file and named by the tests. Reading and running the
source is reference_source.py; this file holds the inputs, the cases and what is written.
"""

import argparse
import json
import pathlib
import types

import numpy as np
import torch
from reference_source import ActorConfig, AlgoConfig, Batch, load_trl_dpo_losses, load_verl, resolve

HERE = pathlib.Path(__file__).parent
torch.set_default_dtype(torch.float64)


# -- inputs that exercise every branch ----------------------------------------------------------

# Rows: full, three tokens then padding, a single token, fully masked, a hole (environment tokens).
MASK = torch.tensor(
    [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 1, 1]],
    dtype=torch.float64,
)
# Log-ratios log p - log p_old: inside the clip range, below and above it, above the dual-clip bound
# (ratio > 3), and beyond the +-20 clamp.
LOG_RATIO = torch.tensor(
    [[0.05, -0.5, 0.4, 1.5, -0.1, 0.0], [25.0, -0.02, 0.3, 2.0, 0.0, 0.0], [-25.0, 0.0, 0.0, 0.0, 0.0, 0.0],
     [0.3, -0.3, 1.2, 0.0, 0.0, 0.0], [1.3, -1.0, 0.7, -0.7, 0.15, 0.22]],
)  # fmt: skip
ADVANTAGES = torch.tensor(
    [[1.0, -1.0, -1.0, -0.5, -2.0, 0.0], [-1.5, 0.8, 1.2, -1.0, 0.0, 0.0], [0.7, 0.0, 0.0, 0.0, 0.0, 0.0],
     [1.0, -1.0, 1.0, 0.0, 0.0, 0.0], [-0.6, 0.9, 0.0, 0.0, 1.1, 1.3]],
)  # fmt: skip
OLD = -torch.linspace(0.5, 3.0, 30).reshape(5, 6)
LOGP = OLD + LOG_RATIO
AGG_MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def t(x: torch.Tensor) -> list:
    return x.detach().double().tolist()


def policy_cases(verl) -> list[dict]:
    """compute_policy_loss_vanilla: per-token losses (one-hot masks), every aggregation, gradients, clip fractions."""
    cases = []
    for clip_low, clip_high, clip_c in [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.2, 0.28, 10.0)]:
        config = ActorConfig(clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c)
        per_token = torch.zeros_like(MASK)
        for i, j in MASK.nonzero().tolist():
            one_hot = torch.zeros_like(MASK)
            one_hot[i, j] = 1.0
            per_token[i, j] = verl.core.compute_policy_loss_vanilla(OLD, LOGP, ADVANTAGES, one_hot, "token-mean", config)[0]
        aggregated, grads = {}, {}
        for mode in AGG_MODES:
            logp = LOGP.clone().requires_grad_(True)
            loss, metrics = verl.core.compute_policy_loss_vanilla(OLD, logp, ADVANTAGES, MASK, mode, config)
            loss.backward()
            aggregated[mode], grads[mode] = loss.item(), t(logp.grad)
        cases.append({
            "params": {"clip_eps_low": clip_low, "clip_eps_high": clip_high, "clip_ratio_c": clip_c},
            "per_token": t(per_token), "aggregated": aggregated, "grad": grads,
            "clipfrac": metrics["actor/pg_clipfrac"], "clipfrac_lower": metrics["actor/pg_clipfrac_lower"],
        })  # fmt: skip
    return cases


def gspo_cases(verl) -> list[dict]:
    cases = []
    for clip_low, clip_high in [(0.2, 0.2), (3e-4, 4e-4)]:
        config = ActorConfig(clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high)
        logp = LOGP.clone().requires_grad_(True)
        loss, metrics = verl.core.compute_policy_loss_gspo(OLD, logp, ADVANTAGES, MASK, "seq-mean-token-mean", config)
        loss.backward()
        cases.append({
            "params": {"clip_eps_low": clip_low, "clip_eps_high": clip_high},
            "loss": loss.item(), "grad": t(logp.grad), "clipfrac": metrics["actor/pg_clipfrac"],
        })  # fmt: skip
    return cases


def cispo_cases(verl) -> list[dict]:
    cases = []
    for clip_low, clip_high in [(0.2, 0.2), (0.2, 0.28)]:
        config = ActorConfig(clip_ratio=0.2, clip_ratio_low=clip_low, clip_ratio_high=clip_high)
        aggregated, grads = {}, {}
        for mode in AGG_MODES:
            logp = LOGP.clone().requires_grad_(True)
            loss, metrics = verl.core.compute_policy_loss_cispo(OLD, logp, ADVANTAGES, MASK, mode, config)
            loss.backward()
            aggregated[mode], grads[mode] = loss.item(), t(logp.grad)
        cases.append({"params": {"clip_eps_low": clip_low, "clip_eps_high": clip_high}, "aggregated": aggregated,
                      "grad": grads, "clipfrac": metrics["actor/pg_clipfrac"]})  # fmt: skip
    return cases


def sapo_cases(verl) -> list[dict]:
    cases = []
    for tau_pos, tau_neg in [(1.0, 1.05), (2.0, 4.0)]:
        config = ActorConfig(tau_pos=tau_pos, tau_neg=tau_neg)
        logp = LOGP.clone().requires_grad_(True)
        loss, _ = verl.core.compute_policy_loss_sapo(OLD, logp, ADVANTAGES, MASK, "seq-mean-token-mean", config)
        loss.backward()
        cases.append({"params": {"tau_pos": tau_pos, "tau_neg": tau_neg}, "loss": loss.item(), "grad": t(logp.grad)})
    return cases


def reinforce_cases(verl) -> list[dict]:
    """compute_policy_loss_reinforce, with no weights and with verl's bypass-mode weights: token TIS of the
    current policy against the rollout one (OLD here), computed by compute_rollout_correction_weights."""
    weights, _ = verl.corr.compute_rollout_correction_weights(LOGP - OLD, MASK, "token", 2.0, False)
    cases = []
    for with_weights in (False, True):
        for mode in ("seq-mean-token-sum", "token-mean"):
            logp = LOGP.clone().requires_grad_(True)
            loss, _ = verl.core.compute_policy_loss_reinforce(
                OLD, logp, ADVANTAGES, MASK, mode, ActorConfig(), weights if with_weights else None
            )
            loss.backward()
            cases.append({"is_weights": t(weights) if with_weights else None, "mode": mode, "loss": loss.item(),
                          "grad": t(logp.grad)})  # fmt: skip
    return cases


def agg_cases(verl) -> dict:
    values = torch.arange(30, dtype=torch.float64).reshape(5, 6) / 7 - 2
    out = {mode: verl.core.agg_loss(values, MASK, mode).item() for mode in AGG_MODES}
    out["seq-mean-token-sum-norm/scale=8"] = verl.core.agg_loss(values, MASK, "seq-mean-token-sum-norm", loss_scale_factor=8).item()
    return {"values": t(values), "expected": out}


def grpo_cases(verl) -> list[dict]:
    # Groups: mixed rewards (4), all equal (3), a group of one, two different, a group of one with reward 0.
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.3, 0.3, 0.3, 0.8, 2.0, -1.0, 0.0])
    index = np.array(["a", "a", "a", "a", "b", "b", "b", "c", "d", "d", "e"], dtype=object)
    mask = torch.ones(11, 4)
    mask[1, 2:] = 0
    mask[7, 1:] = 0
    token_rewards = torch.zeros(11, 4)
    last = mask.cumsum(-1).argmax(-1)
    token_rewards[torch.arange(11), last] = rewards
    cases = []
    for norm_std in (True, False):
        scores, _ = verl.core.compute_grpo_outcome_advantage(token_rewards.clone(), mask, index, 1e-6, norm_std)
        cases.append({"norm_std": norm_std, "advantages": t(scores)})
    rloo, _ = verl.core.compute_rloo_outcome_advantage(token_rewards.clone(), mask, index)
    baseline, _ = verl.core.compute_reinforce_plus_plus_baseline_outcome_advantage(token_rewards.clone(), mask, index)
    return [{"rewards": t(rewards), "group_index": [ord(g) - ord("a") for g in index], "mask": t(mask), "cases": cases,
             "rloo": t(rloo), "reinforce_plus_plus_baseline": t(baseline)}]  # fmt: skip


def gae_cases(verl) -> list[dict]:
    mask = MASK.clone()
    values = torch.linspace(-0.7, 1.1, 30).reshape(5, 6).sin()
    token_rewards = torch.zeros_like(mask)
    token_rewards[0, 5], token_rewards[1, 2], token_rewards[2, 0], token_rewards[4, 5] = 1.0, -0.5, 2.0, 0.7
    token_rewards[0, 2] = 0.3  # an intermediate (process) reward
    out = []
    for gamma, lam in [(1.0, 1.0), (0.9, 0.8), (0.99, 0.95)]:
        advantages, returns = verl.core.compute_gae_advantage_return(token_rewards, values, mask, gamma, lam)
        rf_advantages, rf_returns = verl.core.compute_reinforce_plus_plus_outcome_advantage(
            token_rewards, mask, AlgoConfig(gamma=gamma)
        )
        out.append({"gamma": gamma, "lam": lam, "advantages": t(advantages), "returns": t(returns),
                    "reinforce_plus_plus_advantages": t(rf_advantages), "reinforce_plus_plus_returns": t(rf_returns)})  # fmt: skip
    return [{"token_rewards": t(token_rewards), "values": t(values), "mask": t(mask), "cases": out}]


def value_cases(verl) -> dict:
    old = torch.linspace(-1, 1, 30).reshape(5, 6)
    vpreds = old + torch.linspace(-0.5, 0.5, 30).reshape(5, 6).flip(-1)
    returns = torch.linspace(1.5, -1.5, 30).reshape(5, 6)
    per_token = torch.zeros_like(MASK)
    for i, j in MASK.nonzero().tolist():
        one_hot = torch.zeros_like(MASK)
        one_hot[i, j] = 1.0
        per_token[i, j] = verl.core.compute_value_loss(vpreds, returns, old, one_hot, 0.2, "token-mean")[0]
    loss, clipfrac = verl.core.compute_value_loss(vpreds, returns, old, MASK, 0.2, "token-mean")
    return {"vpreds": t(vpreds), "returns": t(returns), "old_values": t(old), "clip_eps": 0.2,
            "per_token": t(per_token), "token_mean": loss.item(), "clipfrac": clipfrac.item()}  # fmt: skip


def kl_cases(verl) -> dict:
    # log p - log q from -30 to 30, including both sides of the +-20 clamp and of k3's cap at 10.
    diffs = torch.tensor([[-30.0, -25.0, -19.0, -3.0, -0.5, 0.0], [0.1, 0.7, 2.5, 4.0, 19.5, 30.0]])
    ref = torch.full_like(diffs, -2.0)
    logp = ref + diffs
    out = {}
    for name in ("k1", "k2", "k3", "abs"):
        x = logp.clone().requires_grad_(True)
        kl = verl.core.kl_penalty(x, ref, name)
        kl.sum().backward()
        out[name] = {"kl": t(kl), "grad": t(x.grad)}
    return {"logprobs": t(logp), "ref_logprobs": t(ref), "expected": out}


def kl_reward_cases(verl) -> list[dict]:
    scores = torch.zeros_like(MASK)
    scores[0, 5], scores[1, 2], scores[4, 5] = 1.0, -1.0, 0.5
    ref = OLD - LOG_RATIO.clamp(-3, 3) / 2
    out = []
    for name, coef in [("k1", 0.1), ("k3", 0.05), ("k2", 0.2), ("abs", 0.1)]:
        data = types.SimpleNamespace(batch=Batch(response_mask=MASK, token_level_scores=scores, old_log_probs=OLD, ref_log_prob=ref))
        verl.apply_kl_penalty(data, verl.core.FixedKLController(coef), name)
        out.append({"estimator": name, "coef": coef, "token_rewards": t(data.batch["token_level_rewards"])})
    return [{"scores": t(scores), "logprobs": t(OLD), "ref_logprobs": t(ref), "mask": t(MASK), "cases": out}]


def is_weight_cases(verl) -> list[dict]:
    # Behaviour (rollout) logprobs against the proximal (old_log_prob) ones; small log-ratios so that some
    # sequence products stay below the cap.
    rollout = OLD - LOG_RATIO.clamp(-1.2, 1.2) / 3
    out = []
    for level in ("token", "sequence"):
        for normalize in (False, True):
            weights, _ = verl.corr.compute_rollout_correction_weights(OLD - rollout, MASK, level, 2.0, normalize)
            out.append({"level": level, "normalize": normalize, "cap": 2.0, "weights": t(weights)})
    return [{"proximal": t(OLD), "behaviour": t(rollout), "mask": t(MASK), "cases": out}]


def rejection_cases(verl) -> list[dict]:
    log_ratio = LOG_RATIO.clamp(-3, 3) / 4
    specs = [
        ("token_k1", "1.3", 1.3, None), ("token_k1", "0.6_1.5", 1.5, 0.6), ("token_k2", "0.02", 0.02, None),
        ("token_k3", "0.03", 0.03, None), ("seq_sum_k1", "0.5_2.0", 2.0, 0.5), ("seq_sum_k2", "0.1", 0.1, None),
        ("seq_sum_k3", "0.1", 0.1, None), ("seq_mean_k1", "1.1", 1.1, None), ("seq_mean_k2", "0.02", 0.02, None),
        ("seq_mean_k3", "0.02", 0.02, None), ("seq_max_k2", "0.1", 0.1, None), ("seq_max_k3", "0.1", 0.1, None),
    ]  # fmt: skip
    out = []
    for option, spec, upper, lower in specs:
        kept, _ = verl.corr.compute_rollout_rejection_mask(log_ratio, MASK, option, spec)
        out.append({"statistic": option, "threshold": spec, "upper": upper, "lower": lower, "mask": t(kept)})
    return [{"log_ratio": t(log_ratio), "mask": t(MASK), "cases": out}]


def dpo_cases(trl_losses) -> list[dict]:
    # Six pairs: margins positive, negative, zero, large; chosen/rejected lengths including 1 and 0 tokens.
    chosen = torch.tensor([-4.0, -10.0, -7.0, -1.0, -30.0, -2.0])
    rejected = torch.tensor([-6.0, -8.0, -7.0, -40.0, -5.0, -3.0])
    ref_chosen = torch.tensor([-5.0, -9.0, -7.0, -2.0, -20.0, -2.5])
    ref_rejected = torch.tensor([-5.0, -9.0, -7.0, -20.0, -6.0, -2.0])
    chosen_tokens = [3, 5, 1, 4, 6, 2]
    rejected_tokens = [2, 5, 1, 6, 0, 3]
    width = 9  # prompt of 2 + up to 7 completion tokens
    completion_mask = torch.zeros(12, width, dtype=torch.int64)
    for row, n in enumerate(chosen_tokens + rejected_tokens):
        completion_mask[row, 2 : 2 + n] = 1
    out = []
    for loss_type in ("sigmoid", "hinge", "ipo"):
        for beta in (0.1, 0.5):
            losses = trl_losses(loss_type, beta, chosen, rejected, ref_chosen, ref_rejected, completion_mask)
            out.append({"loss_type": loss_type, "beta": beta, "losses": t(losses)})
    return [{
        "chosen": t(chosen), "rejected": t(rejected), "ref_chosen": t(ref_chosen), "ref_rejected": t(ref_rejected),
        "chosen_tokens": chosen_tokens, "rejected_tokens": rejected_tokens, "cases": out,
    }]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", required=True, help="git checkout or mirror of volcengine/verl")
    parser.add_argument("--trl", required=True, help="git checkout or mirror of huggingface/trl")
    parser.add_argument("--verl-commit", default="HEAD")
    parser.add_argument("--trl-commit", default="HEAD")
    args = parser.parse_args()

    verl_commit = resolve(args.verl, args.verl_commit)
    verl = load_verl(args.verl, verl_commit)
    inputs = {"mask": t(MASK), "logprobs": t(LOGP), "old_logprobs": t(OLD), "advantages": t(ADVANTAGES)}
    verl_data = {
        "reference": {"repo": "volcengine/verl", "commit": verl_commit},
        "inputs": inputs,
        "policy_loss_vanilla": policy_cases(verl),
        "policy_loss_gspo": gspo_cases(verl),
        "policy_loss_cispo": cispo_cases(verl),
        "policy_loss_sapo": sapo_cases(verl),
        "policy_loss_reinforce": reinforce_cases(verl),
        "agg_loss": agg_cases(verl),
        "grpo_outcome_advantage": grpo_cases(verl),
        "gae_advantage_return": gae_cases(verl),
        "value_loss": value_cases(verl),
        "kl_penalty": kl_cases(verl),
        "apply_kl_penalty": kl_reward_cases(verl),
        "rollout_correction_weights": is_weight_cases(verl),
        "rollout_rejection_mask": rejection_cases(verl),
    }
    (HERE / "verl.json").write_text(json.dumps(verl_data) + "\n")

    trl_commit = resolve(args.trl, args.trl_commit)
    trl_data = {"reference": {"repo": "huggingface/trl", "commit": trl_commit},
                "dpo_losses": dpo_cases(load_trl_dpo_losses(args.trl, trl_commit))}  # fmt: skip
    (HERE / "trl_dpo.json").write_text(json.dumps(trl_data) + "\n")
    print(f"verl {verl_commit}, trl {trl_commit}: wrote {HERE / 'verl.json'} and {HERE / 'trl_dpo.json'}")


if __name__ == "__main__":
    main()
