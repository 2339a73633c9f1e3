"""Algorithm options the learner passes on to the pure functions (grpo_group_of_one, loss_norm_seqs, dynamic_sampling)."""

import pytest
import torch
from test_trainer_step import config, local, make_samples

from trainer.advantages import grpo_advantages
from trainer.config.algorithm import AlgorithmConfig
from trainer.learner import Learner
from trainer.losses import loss_weights


@pytest.mark.parametrize("group_of_one", ["score", "zero"])
def test_a_group_of_one_gets_its_score_or_zero(tiny_model_dir, group_of_one):
    samples = make_samples(count=8, group=4)[:5]  # groups p0 (4 samples) and p1 (one sample)
    learner = Learner(config(tiny_model_dir, algorithm={"name": "grpo", "grpo_group_of_one": group_of_one}), local())
    (mini_batch,) = learner.prepare(samples)
    single = mini_batch.advantages[4][mini_batch.loss_mask[4] > 0]
    expected = samples[4].reward / (1 + 1e-6) if group_of_one == "score" else 0.0
    torch.testing.assert_close(single, torch.full_like(single, expected))


@pytest.mark.parametrize("norm_seqs", [False, True])
def test_loss_norm_seqs_reaches_the_loss_weights(tiny_model_dir, norm_seqs):
    algorithm = {"name": "grpo", "loss_agg": "seq_mean_token_sum_norm", "loss_norm_length": 16, "loss_norm_seqs": norm_seqs}
    learner = Learner(config(tiny_model_dir, algorithm=algorithm), local())
    (mini_batch,) = learner.prepare(make_samples())
    expected = loss_weights(mini_batch.loss_mask, "seq_mean_token_sum_norm", 16, norm_seqs)
    torch.testing.assert_close(mini_batch.loss_weights, expected)
    assert mini_batch.loss_weights.max() == pytest.approx(1 / 16 / (8 if norm_seqs else 1))


def test_dynamic_sampling_drops_groups_of_equal_rewards_and_counts_them(tiny_model_dir):
    """DAPO: groups whose rewards are all equal leave the batch (a group of one stays, as verl's DAPO keeps it);
    the kept groups' advantages are GRPO's over them alone; the counts reach the step metrics."""
    samples = make_samples(count=8, group=4)[:7]  # p0: 4 samples, p1: 3
    for sample in samples[:4]:
        sample.reward = 1.0  # p0 all equal
    samples.append(make_samples(count=12, group=4)[8])
    samples[-1].prompt_id = samples[-1].group_id = "single"  # a group of one
    learner = Learner(config(tiny_model_dir, algorithm={"name": "grpo", "dynamic_sampling": True}), local())
    (mini_batch,) = learner.prepare(samples)
    assert mini_batch.num_rows == 4  # p1's 3 and the single one
    kept = samples[4:]
    rewards = torch.tensor([s.reward for s in kept])
    expected = grpo_advantages(rewards, torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(mini_batch.advantages, expected[:, None] * mini_batch.loss_mask)
    metrics = learner.train_step(mini_batch, 0)
    assert (metrics["dropped_groups"], metrics["dropped_samples"], metrics["samples"]) == (1.0, 4.0, 4.0)
    assert learner.prepare(samples[:4]) == []  # nothing left to train: no step
    (mini_batch,) = learner.prepare(samples[4:])
    metrics = learner.train_step(mini_batch, 1)
    assert (metrics["dropped_groups"], metrics["dropped_groups_total"], metrics["dropped_samples_total"]) == (0.0, 2.0, 8.0)


def test_dynamic_sampling_off_keeps_every_group(tiny_model_dir):
    samples = make_samples()
    for sample in samples[:4]:
        sample.reward = 1.0
    learner = Learner(config(tiny_model_dir, algorithm={"name": "grpo"}), local())
    (mini_batch,) = learner.prepare(samples)
    assert mini_batch.num_rows == 8 and "dropped_groups" not in learner.train_step(mini_batch, 0)
    with pytest.raises(ValueError, match="dynamic_sampling: grpo only"):
        AlgorithmConfig(name="ppo", dynamic_sampling=True)
