"""Batches of any size: a whole-group batch short of a FAILED member (or one group larger than the batch)
trains with the loss normalised over the samples it really holds; padding rows for ranks and mini-batches
weigh nothing."""

import numpy as np
import pytest
import torch

from protos.sample import Sample
from trainer.batch import collate, plan_mini_batches
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.model import load_policy, run_policy
from trainer.parallel import DistEnv


def local() -> DistEnv:
    return DistEnv(rank=0, world_size=1, device=torch.device("cpu"))


def grouped_samples(group_sizes: list[int], seed: int = 11) -> list[Sample]:
    """Groups of the given sizes (a FAILED member already dropped), varied lengths, masked tokens."""
    rng = np.random.default_rng(seed)
    samples = []
    for g, size in enumerate(group_sizes):
        for k in range(size):
            i = len(samples)
            prompt_len, response_len = 2 + i % 3, 2 + (5 * i) % 6
            loss_mask = np.ones(response_len, dtype=np.uint8)
            loss_mask[0] = i % 3 != 0  # some responses start with an environment token
            samples.append(Sample(
                sample_id=f"g{g}-{k}", prompt_id=f"p{g}", group_id=f"p{g}", group_size=8,
                prompt_ids=np.r_[1, rng.integers(3, 90, prompt_len - 1)].astype(np.int32),
                response_ids=rng.integers(3, 90, response_len).astype(np.int32),
                loss_mask=loss_mask,
                rollout_logprobs=np.full(response_len, -4.0, dtype=np.float32),
                weight_versions=np.zeros(response_len, dtype=np.int64),
                reward=float(rng.integers(0, 3)),
            ))
    return samples


def with_policy_logprobs(model_dir, samples: list[Sample]) -> list[Sample]:
    """Rollout logprobs equal to the initial policy's: the GRPO ratio starts at exactly 1."""
    batch = collate(samples)
    with torch.no_grad():
        logprobs = run_policy(load_policy(model_dir), batch.input_ids, batch.attention_mask).logprobs
    for row, s in enumerate(samples):
        start = s.prompt_ids.size - 1
        s.rollout_logprobs = logprobs[row, start : start + s.response_ids.size].numpy().astype(np.float32)
    return samples


def hand_loss(policy, samples: list[Sample], algorithm: str) -> tuple[float, dict[str, torch.Tensor]]:
    """The loss and gradient of `policy` written out per sample: token mean (SFT) or mean over sequences
    of each sequence's token mean of -A * ratio (GRPO), over exactly these samples."""
    terms = []
    rewards_by_group: dict[str, list[float]] = {}
    for s in samples:
        rewards_by_group.setdefault(s.group_id, []).append(s.reward)
    total_tokens = sum(int(s.loss_mask.sum()) for s in samples)
    trained_sequences = sum(int(s.loss_mask.sum() > 0) for s in samples)
    for s in samples:
        ids = torch.tensor(np.r_[s.prompt_ids, s.response_ids], dtype=torch.int64)[None]
        logprobs = run_policy(policy, ids, torch.ones_like(ids)).logprobs[0, s.prompt_ids.size - 1 :]
        mask = torch.tensor(s.loss_mask, dtype=torch.float32)
        if algorithm == "sft":
            terms.append(-(logprobs * mask).sum() / total_tokens)
            continue
        group = np.array(rewards_by_group[s.group_id])
        spread = group.std(ddof=1) if group.size > 1 else 0.0
        advantage = 0.0 if np.ptp(group) == 0 else (s.reward - group.mean()) / (spread + 1e-6)
        ratio = torch.exp(logprobs - torch.tensor(s.rollout_logprobs))
        if mask.sum() > 0:
            terms.append(-(advantage * ratio * mask).sum() / mask.sum() / trained_sequences)
    loss = torch.stack(terms).sum()
    loss.backward()
    return float(loss.detach()), {name: p.grad.clone() for name, p in policy.named_parameters()}


def trained_step(learner: Learner, samples: list[Sample]) -> tuple[list[dict], list[dict[str, torch.Tensor]]]:
    """Metrics and pre-step gradients of every mini-batch step of one pulled batch."""
    grads: list[dict[str, torch.Tensor]] = []
    learner.optimizer.register_step_pre_hook(
        lambda *_: grads.append({name: p.grad.clone() for name, p in learner.policy.named_parameters()})
    )
    metrics = [learner.train_step(mini, step) for step, mini in enumerate(learner.prepare(samples))]
    return metrics, grads


@pytest.mark.parametrize("algorithm", ["sft", "grpo"])
def test_a_batch_of_63_with_a_group_of_7_trains_as_normalised_by_hand(tiny_model_dir, algorithm):
    samples = with_policy_logprobs(tiny_model_dir, grouped_samples([8] * 7 + [7]))
    assert len(samples) == 63
    config = TrainerConfig.model_validate({
        "model_path": str(tiny_model_dir), "algorithm": {"name": algorithm}, "optim": {"max_grad_norm": None},
        "batch": {"global_batch_size": 64, "micro_batch_size": 8},
    })
    (metrics,), (grads,) = trained_step(Learner(config, local()), samples)
    expected_loss, expected_grads = hand_loss(load_policy(tiny_model_dir), samples, algorithm)
    assert metrics["samples"] == 63 and metrics["tokens"] == sum(int(s.loss_mask.sum()) for s in samples)
    assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-6, rel=1e-5)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-7, rtol=1e-4, msg=name)


def test_mini_batches_of_an_odd_batch_are_padded_with_rows_that_weigh_nothing(tiny_model_dir):
    samples = grouped_samples([8] * 7 + [7])
    config = TrainerConfig.model_validate({
        "model_path": str(tiny_model_dir), "algorithm": {"name": "sft"}, "optim": {"max_grad_norm": None},
        "batch": {"global_batch_size": 64, "micro_batch_size": 8, "mini_batches": 2},
    })
    learner = Learner(config, local())
    first, second = learner.prepare(samples)
    assert first.num_rows == second.num_rows == 32
    assert second.row_weights.gt(0).sum() == 31  # 63 = 32 + 31 real rows, one padding row
    # Each step's loss and gradient are the hand-normalised ones of its own samples (32, then 31 + padding).
    for step, (mini, chunk) in enumerate([(first, samples[:32]), (second, samples[32:])]):
        before = load_policy(tiny_model_dir)
        before.load_state_dict(learner.policy.state_dict())
        expected_loss, expected_grads = hand_loss(before, chunk, "sft")
        grads: list[dict[str, torch.Tensor]] = []
        hook = learner.optimizer.register_step_pre_hook(
            lambda *_, into=grads: into.append({name: p.grad.clone() for name, p in learner.policy.named_parameters()}))
        metrics = learner.train_step(mini, step)
        hook.remove()
        assert metrics["samples"] == len(chunk) and metrics["tokens"] == sum(int(s.loss_mask.sum()) for s in chunk)
        assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)
        for name, grad in expected_grads.items():
            torch.testing.assert_close(grads[0][name], grad, atol=1e-7, rtol=1e-4, msg=name)


def test_a_group_larger_than_the_batch_trains_in_one_step(tiny_model_dir):
    config = TrainerConfig.model_validate({
        "model_path": str(tiny_model_dir), "algorithm": {"name": "grpo"},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4},
    })
    metrics, _ = trained_step(Learner(config, local()), grouped_samples([16]))
    assert len(metrics) == 1 and metrics[0]["samples"] == 16


def test_plan_mini_batches_splits_evenly_and_pads_for_every_rank():
    assert plan_mini_batches(63, 1, 1) == ([range(63)], 63)
    assert plan_mini_batches(63, 1, 2) == ([range(63)], 64)
    assert plan_mini_batches(63, 2, 2) == ([range(32), range(32, 63)], 32)
    assert plan_mini_batches(7, 4, 2) == ([range(2), range(2, 4), range(4, 6), range(6, 7)], 2)
    assert plan_mini_batches(3, 4, 1) == ([range(1), range(1, 2), range(2, 3)], 1)  # no empty step
    # DPO pairs stay whole: 5 pairs over 2 steps and 2 ranks.
    assert plan_mini_batches(10, 2, 2, unit=2) == ([range(6), range(6, 10)], 8)
    with pytest.raises(ValueError, match="units of 2"):
        plan_mini_batches(5, 1, 1, unit=2)
