"""Algorithm options the learner passes on to the pure functions (grpo_group_of_one, loss_norm_seqs)."""

import pytest
import torch
from test_trainer_step import config, local, make_samples

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
