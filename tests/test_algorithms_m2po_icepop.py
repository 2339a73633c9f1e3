"""M2PO's second-moment mask (trainer/corrections.py: m2po_mask, `algorithm.m2_threshold`) and IcePop as a preset of
the rejection rules (`rejection: icepop`), on hand-worked values and through Learner.prepare / train_step.

M2PO follows AReaL's get_m2po_loss_mask (inclusionAI/AReaL, areal/utils/functional.py): sort the trained tokens by
M2 = (log pi_prox - log pi_behav)^2, largest first, and drop the fewest of the largest such that the mean M2 of the
rest is below the threshold; every token when none is. The expected masks below are worked by hand from that rule.
"""

import pytest
import torch
from test_algorithms_off_policy import REJECTION, learner_for, reference_samples, response, with_log_ratio
from test_trainer_step import local

from trainer.config.algorithm import AlgorithmConfig, RejectionRule
from trainer.corrections import m2po_mask
from trainer.learner import Learner

# M2 of the trained tokens: 0.25, 0.09, 0.01 | 0.0, 0.04 (the 9.9 is not trained). Largest first: 0.25, 0.09, 0.04,
# 0.01, 0.0; the means of what is left after dropping the first k: k=0 0.078, k=1 0.035, k=2 0.0167, k=3 0.005, k=4 0.
LOG_RATIO = torch.tensor([[0.5, 0.3, 0.1], [0.0, -0.2, 9.9]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


@pytest.mark.parametrize("threshold,expected", [
    (1.0, [[1, 1, 1], [1, 1, 0]]),  # 0.078 < 1: nothing goes
    (0.04, [[0, 1, 1], [1, 1, 0]]),  # 0.078 >= 0.04, 0.035 < 0.04: the 0.25 goes
    (0.03, [[0, 0, 1], [1, 1, 0]]),  # 0.035 >= 0.03, 0.0167 < 0.03: the 0.25 and the 0.09
    (0.001, [[0, 0, 0], [1, 0, 0]]),  # only the M2 = 0 token's mean is below
])  # fmt: skip
def test_m2po_drops_the_largest_second_moments_until_the_mean_is_below_the_threshold(threshold, expected):
    kept = m2po_mask(LOG_RATIO, MASK, threshold)
    torch.testing.assert_close(kept, torch.tensor(expected, dtype=torch.float64))
    assert m2po_mask(LOG_RATIO, torch.zeros_like(MASK), threshold).sum() == 0  # nothing trained: nothing to mask


def test_m2po_drops_every_token_when_no_mean_is_below_the_threshold():
    # Row 0 alone: M2 0.25, 0.09, 0.01; the means left are 0.117, 0.05, 0.01, none below 0.005.
    assert m2po_mask(LOG_RATIO[:1], MASK[:1], 0.005).sum() == 0
    assert m2po_mask(LOG_RATIO[:1], MASK[:1], 0.0101).tolist() == [[0.0, 0.0, 1.0]]


def test_m2po_in_the_learner_masks_the_mini_batch_and_counts_what_it_dropped(tiny_model_dir):
    """On pi_prox vs pi_rollout of the whole mini-batch: the loss mask is m2po_mask's, the advantages of dropped
    tokens are 0, the normalisation counts the kept tokens only, and the dropped ones are rejected_tokens."""
    learner = learner_for(tiny_model_dir, off_policy="recompute", m2_threshold=0.04, loss_agg="token_mean")
    samples = with_log_ratio(learner, reference_samples(REJECTION["mask"]), REJECTION["log_ratio"])
    (mini_batch,) = learner.prepare(samples)
    mask = torch.tensor(REJECTION["mask"], dtype=torch.float64)
    expected = m2po_mask(torch.tensor(REJECTION["log_ratio"], dtype=torch.float64), mask, 0.04)
    kept = response(mini_batch.loss_mask, 6)
    torch.testing.assert_close(kept, expected)
    # M2 of the two tokens at |log ratio| 0.75 is 0.5625: they are the ones that go (0.078 mean after them).
    assert kept[1, 0] == kept[2, 0] == 0 and float(mask.sum() - kept.sum()) == 2
    assert (response(mini_batch.advantages, 6)[kept == 0] == 0).all()
    metrics = learner.train_step(mini_batch, 0)
    assert metrics["rejected_tokens"] == 2.0 and metrics["tokens"] == float(kept.sum())
    # The mask needs the whole mini-batch's pi_prox before the step: even with one step per batch, a forward of its own.
    assert not Learner(learner.config, local()).proximal_in_step


def test_icepop_is_the_rejection_preset_of_its_ratio_band(tiny_model_dir):
    """IcePop keeps a token while pi_trainer / pi_rollout is within [0.5, 5]: pi_rollout / pi_trainer in [0.2, 2]."""
    config = AlgorithmConfig(off_policy="recompute", rejection="icepop")
    assert config.rejection == [RejectionRule(statistic="token_k1", lower=0.2, upper=2.0)]
    learner = learner_for(tiny_model_dir, off_policy="recompute", rejection="icepop", loss_agg="token_mean")
    (mini_batch,) = learner.prepare(with_log_ratio(learner, reference_samples(REJECTION["mask"]), REJECTION["log_ratio"]))
    kept = response(mini_batch.loss_mask, 6)
    # Only row 2's first token leaves the band: log ratio -0.75 < log 0.5; row 1's +0.75 (ratio 2.1) stays.
    dropped = torch.tensor(REJECTION["mask"], dtype=torch.float64) - kept
    assert dropped.sum() == 1 and dropped[2, 0] == 1


def test_m2po_and_presets_are_checked():
    with pytest.raises(ValueError, match="m2_threshold: M2PO needs off_policy"):
        AlgorithmConfig(m2_threshold=0.04)
    with pytest.raises(ValueError, match="unknown preset 'icepoop'"):
        AlgorithmConfig(off_policy="recompute", rejection="icepoop")
    with pytest.raises(ValueError, match="rejection: needs off_policy"):
        AlgorithmConfig(rejection="icepop")
