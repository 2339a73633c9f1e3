"""The configurable algorithm paths that sum over ranks (rejection's kept-token counts, M2PO's mask, batch-normalised
importance weights, KL-in-reward sequence scores of groups split over ranks, REINFORCE++ whitening) give on
2 gloo ranks (FSDP2) the single-process steps. Run as a script, as tests/test_trainer_parallel.py is."""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_trainer_parallel import _run, make_samples

STEPS = 2
RUNS = {
    "grpo-rejection": {"off_policy": "tis", "is_level": "sequence", "is_batch_normalize": True,
                       "rejection": [{"statistic": "token_k1", "upper": 1.3}, {"statistic": "seq_mean_k2", "upper": 0.05}]},
    "rloo-kl-reward": {"advantage_estimator": "rloo", "kl_reward_coef": 0.1, "off_policy": "recompute",
                       "rejection": [{"statistic": "token_k3", "upper": 0.05}], "loss_agg": "token_mean"},
    "reinforce-pp": {"advantage_estimator": "reinforce_plus_plus", "kl_reward_coef": 0.1, "kl_reward_estimator": "k3",
                     "off_policy": "decoupled", "is_batch_normalize": True, "gamma": 0.95},
    "rpp-baseline-bypass": {"advantage_estimator": "reinforce_plus_plus_baseline", "off_policy": "bypass",
                            "policy_loss": "reinforce", "rejection": [{"statistic": "token_k2", "upper": 0.05}]},
    "ppo-rejection": {"name": "ppo", "off_policy": "tis", "kl_reward_coef": 0.05,
                      "rejection": [{"statistic": "seq_max_k3", "upper": 0.2}]},
    # M2PO's mask is taken over each whole mini-batch: the tokens it drops do not depend on the split over ranks.
    "grpo-m2po": {"off_policy": "recompute", "m2_threshold": 0.05},
}


def run_steps(model: str, env) -> dict[str, list[list[float]]]:
    from trainer.config import TrainerConfig
    from trainer.learner import Learner

    results = {}
    for name, algorithm in RUNS.items():
        config = TrainerConfig.model_validate({
            "model_path": model, "ref_model_path": model, "optim": {"lr": 2e-3}, "algorithm": algorithm,
            "batch": {"global_batch_size": 8, "micro_batch_size": 2, "mini_batches": 2},
        })  # fmt: skip
        learner = Learner(config, env)
        samples = make_samples("grpo", 7)  # groups of 4 and 3, split over mini-batches and ranks
        steps = []
        for step in range(STEPS):
            for mini_batch in learner.prepare(samples):
                metrics = learner.train_step(mini_batch, step)
                steps.append([metrics["loss"], metrics["grad_norm"], metrics.get("rejected_tokens", 0.0)])
        results[name] = steps
    return results


def worker(model: str, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from trainer.parallel import init_distributed, shutdown_distributed

    env = init_distributed("cpu")
    results = run_steps(model, env)
    if env.is_main:
        Path(out).write_text(json.dumps(results))
    shutdown_distributed(env)


@pytest.mark.slow
def test_two_ranks_follow_single_process_steps(tiny_model_dir, tmp_path, free_port):
    script = [str(Path(__file__)), "--model", str(tiny_model_dir)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port)]
    _run([*torchrun, *script, "--out", str(tmp_path / "fsdp.json")], tmp_path)
    _run([sys.executable, *script, "--out", str(tmp_path / "single.json")], tmp_path)
    fsdp = json.loads((tmp_path / "fsdp.json").read_text())
    single = json.loads((tmp_path / "single.json").read_text())
    for name, algorithm in RUNS.items():
        assert len(single[name]) == 2 * STEPS and len(fsdp[name]) == 2 * STEPS, name
        np.testing.assert_allclose(fsdp[name], single[name], rtol=0, atol=1e-5, err_msg=name)
        if algorithm.get("rejection") or algorithm.get("m2_threshold"):
            assert any(step[2] > 0 for step in single[name]), f"{name}: no token rejected, the path is not exercised"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker(args.model, args.out)
