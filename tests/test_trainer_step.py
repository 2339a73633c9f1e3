"""One optimizer step of each algorithm on the tiny model: numbers pinned by hand where they can be."""

import math

import numpy as np
import pytest
import torch

from protos.sample import Sample
from trainer.batch import collate, pack_by_tokens, split_packs
from trainer.config import TrainerConfig
from trainer.config.optim import BatchConfig
from trainer.learner import Learner
from trainer.model import run_policy
from trainer.parallel import DistEnv


def local() -> DistEnv:
    return DistEnv(rank=0, world_size=1, device=torch.device("cpu"))


def make_samples(count=8, group=4, seed=3, pairs=False):
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        prompt_len, response_len = 2 + i % 3, 3 + (3 * i) % 5
        samples.append(
            Sample(
                sample_id=f"s{i}",
                prompt_id=f"p{i // (2 if pairs else group)}",
                group_size=2 if pairs else group,
                prompt_ids=np.r_[1, rng.integers(3, 90, prompt_len - 1)].astype(np.int32),
                response_ids=rng.integers(3, 90, response_len).astype(np.int32),
                loss_mask=np.ones(response_len, dtype=np.uint8),
                rollout_logprobs=np.full(response_len, -4.0, dtype=np.float32),
                weight_versions=np.zeros(response_len, dtype=np.int64),
                reward=float(i % 2) if pairs else float(rng.integers(0, 4)),
            )
        )
    return samples


def with_true_logprobs(learner: Learner, samples: list[Sample]) -> list[Sample]:
    """Set each sample's rollout logprobs to the policy's own: as if the rollout engine ran these weights."""
    batch = collate(samples)
    with torch.no_grad():
        logprobs = run_policy(learner.policy, batch.input_ids, batch.attention_mask).logprobs
    for row, s in enumerate(samples):
        start = s.prompt_ids.size - 1
        s.rollout_logprobs = logprobs[row, start : start + s.response_ids.size].numpy().astype(np.float32)
    return samples


def config(model, **fields) -> TrainerConfig:
    base = {"model_path": str(model), "optim": {"lr": 1e-3}, "batch": {"global_batch_size": 8, "micro_batch_size": 4}}
    return TrainerConfig.model_validate({**base, **fields})


def one_step(learner: Learner, samples, step=0) -> dict[str, float]:
    (mini_batch,) = learner.prepare(samples)
    return learner.train_step(mini_batch, step)


@pytest.mark.parametrize("off_policy", ["none", "tis", "decoupled"])
def test_grpo_on_policy_first_step_has_zero_loss_and_unit_ratio(tiny_model_dir, off_policy):
    learner = Learner(config(tiny_model_dir, algorithm={"name": "grpo", "off_policy": off_policy}), local())
    metrics = one_step(learner, with_true_logprobs(learner, make_samples()))
    # On-policy, ratio 1: the loss is minus the mean of the group-centred advantages, i.e. 0.
    assert abs(metrics["loss"]) < 1e-6
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["grad_norm"] > 0
    assert metrics["tokens"] == sum(s.response_ids.size for s in make_samples())


def test_dpo_first_step_loss_is_log_two_with_the_policy_as_reference(tiny_model_dir):
    learner = Learner(config(tiny_model_dir, algorithm={"name": "dpo"}, ref_model_path=str(tiny_model_dir)), local())
    first = one_step(learner, make_samples(pairs=True))
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    second = one_step(learner, make_samples(pairs=True), step=1)
    assert second["loss"] < first["loss"] and second["reward_accuracy"] == 1.0


def test_ppo_first_value_loss_by_hand(tiny_model_dir):
    algorithm = {"name": "ppo", "gamma": 1.0, "lam": 1.0}
    learner = Learner(config(tiny_model_dir, algorithm=algorithm), local())
    samples = make_samples()
    metrics = one_step(learner, samples)
    # Zero critic, gamma = lambda = 1: every token's return is its sequence's reward.
    tokens = sum(s.response_ids.size for s in samples)
    expected = 0.5 * sum(s.response_ids.size * s.reward**2 for s in samples) / tokens
    assert metrics["value_loss"] == pytest.approx(expected, rel=1e-6)


def test_micro_batches_and_mini_batch_split_do_not_change_the_step(tiny_model_dir):
    results = []
    for micro in (1, 2, 8):
        learner = Learner(config(tiny_model_dir, algorithm={"name": "grpo", "off_policy": "tis", "kl_coef": 0.1},
                                 ref_model_path=str(tiny_model_dir), batch={"global_batch_size": 8, "micro_batch_size": micro}), local())
        metrics = one_step(learner, make_samples())
        metrics_2 = one_step(learner, make_samples(), step=1)
        results.append((metrics["loss"], metrics["grad_norm"], metrics_2["loss"], metrics_2["kl"]))
    for other in results[1:]:
        np.testing.assert_allclose(other, results[0], rtol=0, atol=2e-6)


@pytest.mark.parametrize("budget", [8, 16, 40, 1000])
def test_a_token_budget_packs_micro_batches_by_length_and_gives_the_same_step(tiny_model_dir, budget):
    """max_tokens_per_micro_batch: rows sorted by length, packed within the budget; the step is micro_batch_size's."""
    samples = make_samples()
    lengths = [s.prompt_ids.size + s.response_ids.size for s in samples]
    packs = pack_by_tokens(lengths, budget, max_units=8)
    assert sorted(i for pack in packs for i in pack) == list(range(len(samples)))
    for pack in packs:
        assert len(pack) == 1 or len(pack) * max(lengths[i] for i in pack) <= budget, (pack, budget)
    split = split_packs(packs, lengths, 8)
    assert len(split) == 8 and sorted(i for pack in split for i in pack) == list(range(len(samples)))
    with pytest.raises(ValueError, match="cannot make 9 micro-batches"):
        split_packs(packs, lengths, 9)

    results = []
    for batch in ({"micro_batch_size": 8}, {"micro_batch_size": 8, "max_tokens_per_micro_batch": budget}):
        learner = Learner(config(tiny_model_dir, algorithm={"name": "grpo", "off_policy": "tis", "kl_coef": 0.1},
                                 ref_model_path=str(tiny_model_dir), batch={"global_batch_size": 8, **batch}), local())
        rows = learner._micro_rows(collate(samples))
        metrics = one_step(learner, samples)
        metrics_2 = one_step(learner, samples, step=1)
        results.append((len(rows), (metrics["loss"], metrics["grad_norm"], metrics_2["loss"], metrics_2["kl"],
                                    metrics["tokens"])))
    assert results[1][0] == len(packs)
    np.testing.assert_allclose(results[1][1], results[0][1], rtol=0, atol=2e-6)


def test_sft_learns_a_fixed_batch(tiny_model_dir):
    learner = Learner(config(tiny_model_dir, algorithm={"name": "sft"}, optim={"lr": 3e-3}), local())
    losses = [one_step(learner, make_samples(), step)["nll"] for step in range(8)]
    assert losses[-1] < 0.6 * losses[0], losses


def test_distillation_moves_the_student_to_the_teacher(tiny_model_dir, tmp_path):
    from rollout.model.tiny import write_tiny_model

    teacher = write_tiny_model(tmp_path / "teacher", seed=1)
    learner = Learner(config(tiny_model_dir, algorithm={"name": "distill", "off_policy": "tis"},
                             ref_model_path=str(teacher), optim={"lr": 2e-3}), local())
    samples = make_samples()
    batch = collate(samples)

    def squared_gap() -> float:
        with torch.no_grad():
            student = run_policy(learner.policy, batch.input_ids, batch.attention_mask).logprobs
            teacher = run_policy(learner.reference, batch.input_ids, batch.attention_mask).logprobs
        return float((((student - teacher) ** 2) * batch.loss_mask).sum() / batch.loss_mask.sum())

    before = squared_gap()
    for step in range(4):
        one_step(learner, with_true_logprobs(learner, samples), step)
    # On fixed tokens the distillation gradient is that of 0.5 * (log p - log q)^2: the gap shrinks.
    after = squared_gap()
    assert after < 0.5 * before, (before, after)


def test_clear_error_for_a_missing_reference(tiny_model_dir):
    learner = Learner(config(tiny_model_dir, algorithm={"name": "grpo", "kl_coef": 0.1}), local())
    with pytest.raises(ValueError, match="ref_model_path is not set"):
        learner.prepare(make_samples())


def test_batch_config_must_split_evenly():
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        BatchConfig(global_batch_size=8, micro_batch_size=2).check_divisible(3)
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        BatchConfig(global_batch_size=8, micro_batch_size=3).check_divisible(2)
    with pytest.raises(ValueError, match="DPO trains"):
        TrainerConfig(model_path="m", algorithm={"name": "dpo"}, batch={"micro_batch_size": 3, "global_batch_size": 6})


@pytest.mark.gpu
def test_bf16_autocast_step_on_gpu_tracks_float32_on_cpu(tiny_model_dir):
    samples = make_samples()
    cpu = Learner(config(tiny_model_dir, algorithm={"name": "ppo"}), local())
    gpu = Learner(config(tiny_model_dir, algorithm={"name": "ppo"}, dtype="bfloat16", device="cuda"),
                  DistEnv(rank=0, world_size=1, device=torch.device("cuda")))
    on_cpu, on_gpu = one_step(cpu, samples), one_step(gpu, samples)
    assert next(gpu.policy.parameters()).dtype == torch.float32  # autocast computes in bf16, weights stay fp32
    assert on_gpu["loss"] == pytest.approx(on_cpu["loss"], abs=0.05)
    assert on_gpu["value_loss"] == pytest.approx(on_cpu["value_loss"], rel=1e-3)
    assert on_gpu["grad_norm"] == pytest.approx(on_cpu["grad_norm"], rel=0.05)
