"""The configured objectives (trainer/objectives.py) against the references, end to end on one micro-batch.

The numbers are those of tests/data/reference/{verl,trl_dpo}.json (see tests/test_reference_verl.py and
tests/test_reference_trl.py for the functions and revisions): verl's compute_policy_loss_vanilla and
compute_policy_loss_gspo aggregated by agg_loss, and TRL's DPOTrainer loss (the mean over pairs). This
checks that an AlgorithmConfig selects the reference's behaviour by default and that its options
reach the loss.
"""

import json
import pathlib

import pytest
import torch

from trainer.batch import TrainBatch
from trainer.config.algorithm import AlgorithmConfig
from trainer.losses import loss_weights
from trainer.model import PolicyOutput
from trainer.objectives import objective

HERE = pathlib.Path(__file__).parent / "data" / "reference"
VERL = json.loads((HERE / "verl.json").read_text())
TRL = json.loads((HERE / "trl_dpo.json").read_text())
AGG = {"token-mean": "token_mean", "seq-mean-token-sum": "seq_mean_token_sum",
       "seq-mean-token-mean": "seq_mean_token_mean", "seq-mean-token-sum-norm": "seq_mean_token_sum_norm"}  # fmt: skip


def f64(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64)


def close(actual, expected) -> None:
    torch.testing.assert_close(f64(actual).detach(), f64(expected), rtol=1e-7, atol=1e-6)


def micro_batch(mask: torch.Tensor, agg: str, norm_length: int | None = None, **fields) -> TrainBatch:
    rows, width = mask.shape
    return TrainBatch(
        input_ids=torch.zeros(rows, width + 1, dtype=torch.int64), attention_mask=torch.ones(rows, width + 1, dtype=torch.int64),
        loss_mask=mask, rollout_logprobs=torch.zeros_like(mask), versions=torch.zeros(rows, width, dtype=torch.int64),
        rewards=torch.zeros(rows, dtype=torch.float64), group_index=torch.arange(rows), temperatures=torch.ones(rows),
        loss_weights=loss_weights(mask, agg, norm_length), token_weights=loss_weights(mask, "token_mean"),
        row_weights=torch.full((rows,), 1.0 / rows, dtype=torch.float64), **fields,
    )  # fmt: skip


def policy_output(logprobs: torch.Tensor) -> PolicyOutput:
    return PolicyOutput(logprobs=logprobs, entropy=torch.zeros_like(logprobs), values=None)


INPUTS = {name: f64(value) for name, value in VERL["inputs"].items()}
MASK = INPUTS["mask"]


@pytest.mark.parametrize("case", VERL["policy_loss_vanilla"], ids=lambda c: "-".join(map(str, c["params"].values())))
@pytest.mark.parametrize("mode", list(AGG))
def test_grpo_objective_equals_verl_vanilla_policy_loss(case, mode):
    p = case["params"]
    algo = AlgorithmConfig(name="grpo", loss_agg=AGG[mode], loss_norm_length=MASK.shape[-1], **p)
    batch = micro_batch(MASK, AGG[mode], MASK.shape[-1], old_logprobs=INPUTS["old_logprobs"], advantages=INPUTS["advantages"])
    logprobs = INPUTS["logprobs"].clone().requires_grad_(True)
    loss, metrics = objective(algo, batch, policy_output(logprobs))
    loss.backward()
    close(loss, case["aggregated"][mode])
    close(logprobs.grad, case["grad"][mode])
    close(metrics["clip_fraction"], case["clipfrac"])
    close(metrics["dual_clip_fraction"], case["clipfrac_lower"])


def test_dual_clip_is_on_by_default_as_in_verl():
    assert AlgorithmConfig().clip_ratio_c == 3.0
    (default,) = [c for c in VERL["policy_loss_vanilla"] if c["params"] == {"clip_eps_low": 0.2, "clip_eps_high": 0.2, "clip_ratio_c": 3.0}]
    batch = micro_batch(MASK, "token_mean", old_logprobs=INPUTS["old_logprobs"], advantages=INPUTS["advantages"])
    loss, _ = objective(AlgorithmConfig(name="grpo", loss_agg="token_mean"), batch, policy_output(INPUTS["logprobs"]))
    close(loss, default["aggregated"]["token-mean"])


def test_gspo_and_sapo_aggregate_by_sequence_mean_by_default_as_in_verl():
    for name in ("grpo", "ppo"):
        assert AlgorithmConfig(name=name, policy_loss="gspo").loss_agg == "seq_mean_token_mean"
        assert AlgorithmConfig(name=name, policy_loss="sapo").loss_agg == "seq_mean_token_mean"
    assert AlgorithmConfig(name="ppo").loss_agg == "token_mean"
    assert AlgorithmConfig(name="grpo", policy_loss="gspo", loss_agg="token_mean").loss_agg == "token_mean"


@pytest.mark.parametrize("case", VERL["policy_loss_gspo"], ids=lambda c: str(c["params"]["clip_eps_low"]))
def test_gspo_objective_equals_verl_gspo(case):
    algo = AlgorithmConfig(name="grpo", policy_loss="gspo", **case["params"])
    batch = micro_batch(MASK, algo.loss_agg, old_logprobs=INPUTS["old_logprobs"], advantages=INPUTS["advantages"])
    logprobs = INPUTS["logprobs"].clone().requires_grad_(True)
    loss, metrics = objective(algo, batch, policy_output(logprobs))
    loss.backward()
    close(loss, case["loss"])
    close(logprobs.grad, case["grad"])
    close(metrics["clip_fraction"], case["clipfrac"])


@pytest.mark.parametrize(
    ("policy_loss", "case", "expected"),
    [("cispo", c, c["aggregated"]["seq-mean-token-mean"]) for c in VERL["policy_loss_cispo"]]
    + [("sapo", c, c["loss"]) for c in VERL["policy_loss_sapo"]],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_cispo_and_sapo_objectives_equal_verl(policy_loss, case, expected):
    params = {f"sapo_{k}": v for k, v in case["params"].items()} if policy_loss == "sapo" else case["params"]
    algo = AlgorithmConfig(name="grpo", policy_loss=policy_loss, loss_agg="seq_mean_token_mean", **params)
    batch = micro_batch(MASK, "seq_mean_token_mean", old_logprobs=INPUTS["old_logprobs"], advantages=INPUTS["advantages"])
    loss, _ = objective(algo, batch, policy_output(INPUTS["logprobs"]))
    close(loss, expected)


@pytest.mark.parametrize("case", [c for c in VERL["policy_loss_reinforce"] if c["mode"] == "seq-mean-token-sum"],
                         ids=lambda c: f"w{c['is_weights'] is not None}")  # fmt: skip
def test_reinforce_objective_equals_verl(case):
    """REINFORCE with the importance weights a correction put on the batch (here verl's bypass-mode weights)."""
    weights = None if case["is_weights"] is None else f64(case["is_weights"])
    algo = AlgorithmConfig(name="grpo", policy_loss="reinforce", loss_agg="seq_mean_token_sum")
    batch = micro_batch(MASK, "seq_mean_token_sum", old_logprobs=INPUTS["old_logprobs"], advantages=INPUTS["advantages"],
                        is_weights=weights)  # fmt: skip
    logprobs = INPUTS["logprobs"].clone().requires_grad_(True)
    loss, _ = objective(algo, batch, policy_output(logprobs))
    loss.backward()
    close(loss, case["loss"])
    close(logprobs.grad, case["grad"])


@pytest.mark.parametrize("case", TRL["dpo_losses"][0]["cases"], ids=lambda c: f"{c['loss_type']}-{c['beta']}")
def test_dpo_objective_equals_trl(case):
    """Rows (chosen, rejected) interleaved; each row's sequence logprob sits on its first response token. The
    pair whose rejected completion has no token is left out (its sequence logprob could only be 0 here)."""
    pairs = TRL["dpo_losses"][0]
    keep = [i for i, n in enumerate(pairs["rejected_tokens"]) if n > 0]
    width = 1 + max(pairs["chosen_tokens"] + pairs["rejected_tokens"])
    logprobs, ref, mask = (torch.zeros(2 * len(keep), width, dtype=torch.float64) for _ in range(3))
    for row, (i, side) in enumerate((i, side) for i in keep for side in ("chosen", "rejected")):
        mask[row, 1 : 1 + pairs[f"{side}_tokens"][i]] = 1.0
        logprobs[row, 1], ref[row, 1] = pairs[side][i], pairs[f"ref_{side}"][i]
    algo = AlgorithmConfig(name="dpo", dpo_beta=case["beta"], dpo_loss_type=case["loss_type"])
    loss, metrics = objective(algo, micro_batch(mask, "token_mean", ref_logprobs=ref), policy_output(logprobs))
    close(loss, f64(case["losses"])[keep].mean())
    beta_margins = case["beta"] * torch.tensor(
        [(pairs["chosen"][i] - pairs["ref_chosen"][i]) - (pairs["rejected"][i] - pairs["ref_rejected"][i]) for i in keep]
    )
    close(metrics["reward_margin"], beta_margins.mean())  # TRL's rewards/margins
