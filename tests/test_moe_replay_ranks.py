"""Routing replay under data parallelism: FSDP2 over 2 gloo ranks, each replaying its half of the batch's routes,
follows the single-process run (losses, router agreement and expert load within 1e-5), with packing. (The
load-balancing loss is taken per micro-batch, so it depends on how the batch is split: not compared.)

The test runs this file as a script: under `torchrun --nproc_per_node 2`, then as a plain process; each writes its
per-step metrics to JSON.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_trainer_parallel import _run

STEPS = 3
COMPARED = ("loss", "moe/router_agreement", "moe/load_max_over_mean", "moe/load_max_over_mean/0")


def make_samples(count: int = 8):
    """A fixed batch of varied lengths, each sample with routes drawn at random (2 sparse layers, top 2 of 4)."""
    from protos.sample import Sample

    rng = np.random.default_rng(11)
    samples = []
    for i in range(count):
        prompt, response = 2 + i % 3, 3 + (5 * i) % 7
        routes = np.argsort(rng.random((prompt + response - 1, 2, 4)), axis=-1)[..., :2].astype(np.uint8)
        samples.append(Sample(
            sample_id=f"s{i}", prompt_id=f"p{i // 4}", group_size=4,
            prompt_ids=np.r_[1, rng.integers(3, 90, prompt - 1)].astype(np.int32),
            response_ids=rng.integers(3, 90, response).astype(np.int32), loss_mask=np.ones(response, np.uint8),
            rollout_logprobs=np.full(response, -4.0, np.float32), weight_versions=np.zeros(response, np.int64),
            reward=float(rng.integers(0, 3)), routed_experts=routes))
    return samples


def worker(model: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from trainer.config import TrainerConfig
    from trainer.learner import Learner
    from trainer.parallel import init_distributed, shutdown_distributed

    env = init_distributed("cpu")
    config = TrainerConfig.model_validate({
        "model_path": model, "optim": {"lr": 5e-3}, "algorithm": {"name": "grpo", "off_policy": "tis"},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4, "max_tokens_per_micro_batch": 30, "packing": True},
        "moe": {"routing_replay": "rollout"}})
    learner = Learner(config, env)
    metrics = []
    for step in range(STEPS):
        for mini_batch in learner.prepare(make_samples()):
            result = learner.train_step(mini_batch, step)
            metrics.append({name: result[name] for name in COMPARED})
    if env.is_main:
        Path(out).write_text(json.dumps(metrics))
    shutdown_distributed(env)


@pytest.mark.ranks
def test_two_ranks_replaying_their_halves_follow_one_process(tmp_path, free_port):
    from rollout.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=7, num_layers=3, mlp_only_layers=(1,),
                             hidden_size=64, num_heads=2, num_kv_heads=1)
    script = [str(Path(__file__)), "--model", str(model)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port)]
    _run([*torchrun, *script, "--out", str(tmp_path / "fsdp.json")], tmp_path)
    _run([sys.executable, *script, "--out", str(tmp_path / "single.json")], tmp_path)
    fsdp, single = (json.loads((tmp_path / name).read_text()) for name in ("fsdp.json", "single.json"))
    assert len(fsdp) == len(single) == STEPS
    for name in COMPARED:
        np.testing.assert_allclose([m[name] for m in fsdp], [m[name] for m in single], rtol=0, atol=1e-5,
                                   err_msg=name)
    assert abs(single[-1]["loss"] - single[0]["loss"]) > 1e-3  # the loss moves: equal curves are no coincidence
    assert single[0]["moe/router_agreement"] < 0.6  # random routes: the replay is not the routers' own choice


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker(args.model, args.out)
