"""Advantage estimators and KL in the reward as configurations of the one trainer, through Learner.prepare.

Expected values come from verl b178a3cd56f58b2d502255daba591e92833930a7 itself: its grpo/rloo/
reinforce_plus_plus(_baseline) estimators in verl.json (generate.py) and its trainer pipeline, apply_kl_penalty
then the estimator, in verl_pipeline.json (generate_pipeline.py). Samples carry float32 logprobs, hence 1e-5.
"""

import json
import pathlib

import numpy as np
import pytest
import torch
from test_trainer_step import config, local, make_samples, with_true_logprobs

from protos.sample import Sample
from trainer.advantages import discounted_returns, grpo_advantages, kl_reward_penalty, terminal_rewards
from trainer.learner import Learner

HERE = pathlib.Path(__file__).parent / "data" / "reference"
COMMIT = "b178a3cd56f58b2d502255daba591e92833930a7"
VERL = json.loads((HERE / "verl.json").read_text())
PIPELINE = json.loads((HERE / "verl_pipeline.json").read_text())
PROMPT = 2  # response token j sits at column PROMPT - 1 + j


def samples_from(rewards, groups, mask, rollout_logprobs=None, ref_logprobs=None) -> list[Sample]:
    width = len(mask[0])
    samples = []
    for i, (reward, group, row) in enumerate(zip(rewards, groups, mask, strict=True)):
        samples.append(Sample(
            sample_id=f"s{i}", prompt_id=f"g{group}", prompt_ids=np.array([1, 5 + i], dtype=np.int32),
            response_ids=np.arange(10 + i, 10 + i + width, dtype=np.int32) % 90 + 3,
            loss_mask=np.asarray(row, dtype=np.uint8),
            rollout_logprobs=np.asarray(rollout_logprobs[i] if rollout_logprobs else [-2.0] * width, dtype=np.float32),
            weight_versions=np.zeros(width, dtype=np.int64), reward=float(reward),
            ref_logprobs=np.asarray(ref_logprobs[i], dtype=np.float32) if ref_logprobs else np.zeros(0, np.float32),
        ))  # fmt: skip
    return samples


def response(values: torch.Tensor, width: int) -> torch.Tensor:
    return values[:, PROMPT - 1 : PROMPT - 1 + width].double()


def prepared(model, samples, **algorithm):
    learner = Learner(config(model, algorithm=algorithm, batch={"global_batch_size": 8, "micro_batch_size": 1}), local())
    (mini_batch,) = learner.prepare(samples)
    return learner, mini_batch


def test_the_data_comes_from_the_named_revision():
    assert PIPELINE["reference"] == {"repo": "volcengine/verl", "commit": COMMIT}


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_equal_verl(tiny_model_dir, estimator):
    """compute_grpo/rloo/reinforce_plus_plus_baseline_outcome_advantage: equal rewards, groups of one, a
    single-token row; the baseline's whitening runs over the whole pulled batch."""
    data = VERL["grpo_outcome_advantage"][0]
    samples = samples_from(data["rewards"], data["group_index"], data["mask"])
    _, mini_batch = prepared(tiny_model_dir, samples, advantage_estimator=estimator)
    expected = {"grpo": data["cases"][0]["advantages"]}.get(estimator, data.get(estimator))
    torch.testing.assert_close(response(mini_batch.advantages, 4), torch.tensor(expected, dtype=torch.float64),
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", PIPELINE["kl_in_reward_advantages"]["cases"], ids=lambda c: f"{c['kl_estimator']}-{c['coef']}")
@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline", "reinforce_plus_plus/gamma=1.0",
                                       "reinforce_plus_plus/gamma=0.9"])
def test_kl_in_the_reward_then_each_estimator_equals_verl(tiny_model_dir, case, estimator):
    """ray_trainer.apply_kl_penalty on the policy's logprobs before the update (here the rollout's: off_policy
    none) and the samples' reference logprobs, then the estimator, as verl's trainer runs them."""
    data = PIPELINE["kl_in_reward_advantages"]
    mask = torch.tensor(data["mask"])
    rewards = torch.tensor(data["scores"]).sum(-1).tolist()
    samples = samples_from(rewards, data["group_index"], data["mask"], data["logprobs"], data["ref_logprobs"])
    name, _, gamma = estimator.partition("/gamma=")
    algorithm = {"advantage_estimator": name, "kl_reward_coef": case["coef"], "kl_reward_estimator": case["kl_estimator"]}
    learner, mini_batch = prepared(tiny_model_dir, samples, **algorithm, gamma=float(gamma or 1.0))
    assert learner.reference is None  # the samples carry their reference logprobs
    expected = torch.tensor(case["advantages"][estimator], dtype=torch.float64) * mask
    torch.testing.assert_close(response(mini_batch.advantages, 6), expected, rtol=0, atol=1e-5)


def test_reinforce_plus_plus_steps_over_masked_tokens_when_asked(tiny_model_dir):
    data = PIPELINE["kl_in_reward_advantages"]
    rewards = torch.tensor(data["scores"]).sum(-1).tolist()
    samples = samples_from(rewards, data["group_index"], data["mask"])
    runs = {}
    for steps_over in (False, True):
        _, mini_batch = prepared(tiny_model_dir, samples, advantage_estimator="reinforce_plus_plus",
                                 steps_over_masked=steps_over, gamma=0.9)
        runs[steps_over] = response(mini_batch.advantages, 6)
    mask = torch.tensor(data["mask"], dtype=torch.float64)
    returns = discounted_returns(torch.tensor(data["scores"], dtype=torch.float64), mask, 0.9, steps_over_masked=True)
    assert returns[4, 0] > 0 and runs[False][4, 0] < 0 < runs[True][4, 0]  # row 4's reward reaches its first tokens
    torch.testing.assert_close(runs[True][4, :2] > runs[True][3, 0], torch.tensor([True, True]))


def test_ppo_takes_the_kl_penalty_into_its_returns(tiny_model_dir):
    """Zero critic, gamma = lambda = 1: each token's return is the sum of the (penalised) token rewards after it."""
    algorithm = {"name": "ppo", "gamma": 1.0, "lam": 1.0, "kl_reward_coef": 0.2, "kl_reward_estimator": "k2"}
    learner = Learner(config(tiny_model_dir, algorithm=algorithm), local())
    samples = with_true_logprobs(learner, make_samples())  # the recomputed logprobs are the rollout's
    for s in samples:
        s.ref_logprobs = np.linspace(-5, -3, s.response_ids.size).astype(np.float32)
    (mini_batch,) = learner.prepare(samples)
    mask = mini_batch.loss_mask
    token_rewards = kl_reward_penalty(terminal_rewards(mini_batch.rewards, mask), mini_batch.old_logprobs,
                                      mini_batch.ref_logprobs, mask, 0.2, "k2")
    expected = token_rewards.flip(-1).cumsum(-1).flip(-1) * mask
    torch.testing.assert_close(mini_batch.returns, expected, rtol=0, atol=1e-5)
    assert not torch.allclose(expected, terminal_rewards(mini_batch.rewards, mask).flip(-1).cumsum(-1).flip(-1) * mask)


def test_the_default_estimator_is_grpo(tiny_model_dir):
    samples = make_samples()
    _, mini_batch = prepared(tiny_model_dir, samples)
    rewards = torch.tensor([s.reward for s in samples])
    groups = torch.tensor([int(s.group_id[1:]) for s in samples])
    torch.testing.assert_close(mini_batch.advantages, grpo_advantages(rewards, groups)[:, None] * mini_batch.loss_mask)


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_each_estimator_trains_a_step(tiny_model_dir, estimator):
    learner = Learner(config(tiny_model_dir, algorithm={"advantage_estimator": estimator}), local())
    (mini_batch,) = learner.prepare(make_samples())
    metrics = learner.train_step(mini_batch, 0)
    assert metrics["grad_norm"] > 0 and np.isfinite(metrics["loss"])


def test_estimator_and_algorithm_must_agree():
    from trainer.config.algorithm import AlgorithmConfig

    with pytest.raises(ValueError, match="ppo estimates advantages by gae"):
        AlgorithmConfig(name="ppo", advantage_estimator="rloo")
    with pytest.raises(ValueError, match="gae needs a critic"):
        AlgorithmConfig(name="grpo", advantage_estimator="gae")
    with pytest.raises(ValueError, match="reward penalty needs an RL algorithm"):
        AlgorithmConfig(name="sft", kl_reward_coef=0.1)
