"""Activation checkpointing (`model.activation_checkpointing`): each decoder layer runs again in the backward, and
the step's loss and gradients are the plain path's; parameter names (state dicts, checkpoints, publishing) do not
change."""

import numpy as np
import pytest
import torch

from protos.sample import Sample
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.parallel import DistEnv


def samples(count=8) -> list[Sample]:
    rng = np.random.default_rng(4)
    out = []
    for i in range(count):
        prompt_len, response_len = 2 + i % 3, 2 + (3 * i) % 7
        out.append(Sample(
            sample_id=f"s{i}", prompt_id=f"p{i // 4}", group_size=4,
            prompt_ids=np.r_[1, rng.integers(3, 90, prompt_len - 1)].astype(np.int32),
            response_ids=rng.integers(3, 90, response_len).astype(np.int32),
            loss_mask=np.ones(response_len, dtype=np.uint8),
            rollout_logprobs=rng.uniform(-5, -3, response_len).astype(np.float32),
            weight_versions=np.zeros(response_len, dtype=np.int64), reward=float(rng.integers(0, 4)),
        ))
    return out


def step(model_dir, checkpointing: bool, algorithm: str):
    """(loss, gradients, decoder-layer forward calls, parameter names) of one step in float64."""
    config = TrainerConfig.model_validate({
        "model_path": str(model_dir), "algorithm": {"name": algorithm, "entropy_coef": 0.01 if algorithm != "ppo" else 0},
        "optim": {"max_grad_norm": None}, "batch": {"global_batch_size": 8, "micro_batch_size": 4},
        "model": {"activation_checkpointing": checkpointing},
    })
    learner = Learner(config, DistEnv(rank=0, world_size=1, device=torch.device("cpu")))
    learner.policy.double()
    learner.optimizer.step = learner.optimizer.zero_grad = lambda *args, **kwargs: None
    (mini_batch,) = learner.prepare(samples())  # PPO's forward-only passes (old values) are not counted
    calls = []
    for layer in learner.policy.decoder_layers:
        layer.register_forward_pre_hook(lambda *_: calls.append(1))
    metrics = learner.train_step(mini_batch, 0)
    grads = {name: p.grad for name, p in learner.policy.named_parameters() if p.grad is not None}
    return metrics["loss"], grads, len(calls), list(learner.policy.state_dict())


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_checkpointed_layers_give_the_plain_gradients(tiny_model_dir, algorithm):
    plain_loss, plain_grads, plain_calls, plain_names = step(tiny_model_dir, False, algorithm)
    loss, grads, calls, names = step(tiny_model_dir, True, algorithm)
    layers, micro_batches = 2, 2
    assert plain_calls == layers * micro_batches
    assert calls == 2 * plain_calls  # every layer's forward again in the backward
    assert names == plain_names
    assert loss == pytest.approx(plain_loss, abs=1e-12)
    assert set(grads) == set(plain_grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-10, rtol=0, msg=name)
