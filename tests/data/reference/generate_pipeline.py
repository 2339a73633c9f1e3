"""Expected numbers of tests/test_algorithms_estimators.py: verl's trainer pipeline from scores to advantages.

Not run in CI. Runs, with verl's own functions (loaded by reference_source.py), what verl's RayPPOTrainer
does between the reward and the actor update for a critic-free estimator: apply_kl_penalty (use_kl_in_reward,
fixed coefficient) on the token-level scores, then the estimator's compute_*_advantage on the penalised
token-level rewards. Writes verl_pipeline.json beside this file, with the verl commit it ran:

    .venv/bin/python tests/data/reference/generate_pipeline.py --verl /tmp/verl
"""

import argparse
import json
import types

import numpy as np
import torch
from generate import HERE, MASK, OLD, t
from reference_source import AlgoConfig, Batch, load_verl, resolve

GROUPS = ["a", "a", "a", "b", "b"]  # row 3 (no trained token) in a group with row 4 (a masked span)


def pipeline_cases(verl) -> dict:
    scores = torch.zeros_like(MASK)
    scores[0, 5], scores[1, 2], scores[4, 5] = 1.0, -1.0, 0.5  # each on its row's last trained token
    ref = OLD + torch.linspace(-0.6, 0.9, 30).reshape(5, 6).sin()
    index = np.array(GROUPS, dtype=object)
    cases = []
    for estimator_kl, coef in [("k1", 0.0), ("k1", 0.1), ("k3", 0.05)]:
        data = types.SimpleNamespace(batch=Batch(response_mask=MASK, token_level_scores=scores, old_log_probs=OLD, ref_log_prob=ref))
        verl.apply_kl_penalty(data, verl.core.FixedKLController(coef), estimator_kl)
        rewards = data.batch["token_level_rewards"]
        out = {
            "grpo": verl.core.compute_grpo_outcome_advantage(rewards.clone(), MASK, index, 1e-6, True)[0],
            "rloo": verl.core.compute_rloo_outcome_advantage(rewards.clone(), MASK, index)[0],
            "reinforce_plus_plus_baseline":
                verl.core.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards.clone(), MASK, index)[0],
        }  # fmt: skip
        for gamma in (1.0, 0.9):
            out[f"reinforce_plus_plus/gamma={gamma}"] = verl.core.compute_reinforce_plus_plus_outcome_advantage(
                rewards.clone(), MASK, AlgoConfig(gamma=gamma)
            )[0]
        cases.append({"kl_estimator": estimator_kl, "coef": coef, "token_rewards": t(rewards),
                      "advantages": {name: t(value) for name, value in out.items()}})  # fmt: skip
    return {"scores": t(scores), "logprobs": t(OLD), "ref_logprobs": t(ref), "mask": t(MASK),
            "group_index": [ord(g) - ord("a") for g in GROUPS], "cases": cases}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verl", required=True, help="git checkout or mirror of volcengine/verl")
    parser.add_argument("--verl-commit", default="HEAD")
    args = parser.parse_args()
    commit = resolve(args.verl, args.verl_commit)
    data = {"reference": {"repo": "volcengine/verl", "commit": commit}, "kl_in_reward_advantages": pipeline_cases(load_verl(args.verl, commit))}
    (HERE / "verl_pipeline.json").write_text(json.dumps(data) + "\n")
    print(f"verl {commit}: wrote {HERE / 'verl_pipeline.json'}")


if __name__ == "__main__":
    main()
