"""Tensor + sequence parallel, sharded loading and DCP checkpoints, against one process.

One process (in this test's own process) trains GRPO (truncated IS, KL, entropy), PPO (value head, GAE,
decoupled weights, 2 mini-batches) and DPO for 3 steps, checkpointing (DCP) after step 2. This file then
runs as a script under torchrun on gloo: 2 processes as tp 2, or 4 as dp 2 x tp 2. Each rank loads only
its shards of the safetensors file, trains the same steps on the same batch and checkpoints after step 2,
then resumes from the one-process checkpoint and trains the steps after it. Finally this process resumes
from the torchrun checkpoint. Every loss and the updated weights must equal the one-process run's. The
torchrun run also loads a tied-embedding model, saves one step twice with both commits queued (as the
loop's last save can repeat its periodic one), and trains PPO under FSDP2's bf16 policy forced on CPU.

AdamW's eps is 1e-4 here, not 1e-8: an element whose gradient is zero up to rounding (k_proj's bias: the
softmax ignores it) would otherwise move by a sign of rounding noise times lr, on one process as on many.
"""

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_trainer_parallel import RUNS as PARALLEL_RUNS
from test_trainer_parallel import _run, make_samples

STEPS = 3
SAVE_AT = 2
RUNS = {name: PARALLEL_RUNS[name] for name in ("grpo", "ppo", "dpo")}


def run_steps(model: str, env, tp: int, checkpoints: Path, resume_from: Path | None = None) -> dict:
    """Per algorithm: the losses of each step, the policy's weights after the last (rank 0; a file), and
    how many steps resumed from `resume_from` (else trained from the start, checkpointed after SAVE_AT)."""
    import torch

    from trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
    from trainer.config import TrainerConfig
    from trainer.learner import Learner
    from trainer.parallel import gather_model_state

    checkpoints.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, overrides in RUNS.items():
        config = TrainerConfig.model_validate({
            "model_path": model, "ref_model_path": model, "optim": {"lr": 2e-3, "eps": 1e-4},
            "batch": {"global_batch_size": 8, "micro_batch_size": 4, **overrides.get("batch", {})},
            "algorithm": overrides["algorithm"], "parallel": {"tp": tp},
        })  # fmt: skip
        learner = Learner(config, env)
        state = TrainState()
        if resume_from is not None:
            state = load_checkpoint(latest_checkpoint(resume_from / name), learner.policy, learner.optimizer, env)
        samples = make_samples(overrides["algorithm"]["name"])
        losses = []
        while state.step < STEPS:
            for mini_batch in learner.prepare(samples):
                losses.append(learner.train_step(mini_batch, state.step)["loss"])
                state.step += 1
            if state.step == SAVE_AT and resume_from is None:
                save_checkpoint(checkpoints / name, learner.policy, learner.optimizer, state, env)
        weights = gather_model_state(learner.policy, env)
        tag = "resumed" if resume_from is not None else "trained"
        if env.is_main:
            torch.save(weights, checkpoints / f"{name}-{tag}-weights.pt")
        results[name] = losses
    return results


def loading_report(model: str, env) -> dict:
    """What the sharded load read on each rank and what it holds, and whether the weights equal the file's."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from trainer.config.parallel import ParallelConfig
    from trainer.parallel import build_policy, gather_model_state, loading

    reads = []
    original = loading.load_hf_shards

    @functools.wraps(original)
    def counted(lm, path):
        reads.append(original(lm, path))
        return reads[-1]

    loading.load_hf_shards = counted
    policy = build_policy(model, env, ParallelConfig(tp=env.tp_size))
    loading.load_hf_shards = original
    held = sum(p.to_local().numel() * p.element_size() for p in policy.parameters())
    per_rank = [None] * env.world_size
    dist.all_gather_object(per_rank, {"read": reads[0], "held": held})
    full = gather_model_state(policy, env)
    report = {"per_rank": per_rank}
    if env.is_main:
        saved = load_file(Path(model) / "model.safetensors")
        report["model_bytes"] = sum(t.numel() * t.element_size() for t in saved.values())
        report["max_diff"] = max(float((full[f"lm.{name}"] - t).abs().max()) for name, t in saved.items())
        report["same_names"] = sorted(f"lm.{name}" for name in saved) == sorted(full)
    del policy
    torch.distributed.barrier()
    return report


def tied_report(folder: Path, env) -> dict:
    """A model whose LM head is its input embedding: both split alike, they stay one parameter, loaded once."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from rollout.model.tiny import write_tiny_model
    from trainer.config.parallel import ParallelConfig
    from trainer.parallel import build_policy, gather_model_state

    if env.is_main:
        write_tiny_model(folder, tie_word_embeddings=True)
    dist.barrier()
    policy = build_policy(folder, env, ParallelConfig(tp=env.tp_size))
    shared = policy.lm.get_output_embeddings().weight is policy.lm.get_input_embeddings().weight
    full = gather_model_state(policy, env)
    if not env.is_main:
        return {}
    saved = load_file(folder / "model.safetensors")
    return {"shared": shared, "head_saved": "lm_head.weight" in saved,
            "max_diff": max(float((full[f"lm.{name}"] - t).abs().max()) for name, t in saved.items())}


def repeated_save_report(model: str, env, tp: int, root: Path) -> dict:
    """A step saved twice, both commits queued on rank 0's background thread (as the loop saves at its end a
    step it just saved): the checkpoint commits once and loads."""
    from trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
    from trainer.config import TrainerConfig
    from trainer.learner import Learner

    config = TrainerConfig.model_validate({"model_path": model, "parallel": {"tp": tp},
                                           "batch": {"global_batch_size": 8, "micro_batch_size": 4}})
    learner = Learner(config, env)
    queued = []
    for _ in range(2):
        save_checkpoint(root, learner.policy, learner.optimizer, TrainState(step=5), env, submit=queued.append)
    for call in queued:
        call()
    env.barrier()
    state = load_checkpoint(latest_checkpoint(root), learner.policy, learner.optimizer, env)
    return {"step": state.step, "folders": sorted(path.name for path in root.iterdir())}


def _recording(computed: list, token_stats):
    """trainer.lm_head.token_stats, recording the head's weight dtype and the dtype its matmul computes in."""
    from trainer.lm_head import compute_dtype

    def stats(hidden, weight, *args, **kwargs):
        computed.append([str(weight.dtype), str(compute_dtype(hidden, kwargs.get("fp32", False)))])
        return token_stats(hidden, weight, *args, **kwargs)

    return stats


def mixed_precision_report(model: str, env, tp: int) -> dict:
    """PPO's steps in float32, then under FSDP2's bf16 policy as on a GPU (forced here on CPU): the dtypes
    the LM head computes in, the parameters and Adam moments the optimizer steps, and both runs' losses."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from trainer import lm_head
    from trainer.config import TrainerConfig
    from trainer.learner import Learner
    from trainer.parallel import compose

    token_stats = lm_head.token_stats
    report = {}
    original = compose.mixed_precision_policy
    for name in ("float32", "bfloat16"):
        if name == "bfloat16":
            compose.mixed_precision_policy = lambda *_: MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                             reduce_dtype=torch.float32)
        config = TrainerConfig.model_validate({
            "model_path": model, "optim": {"lr": 2e-3}, "dtype": name, "parallel": {"tp": tp},
            "batch": {"global_batch_size": 8, "micro_batch_size": 2}, "algorithm": {"name": "ppo"},
        })  # fmt: skip
        learner = Learner(config, env)
        computed: list[list[str]] = []
        lm_head.token_stats = _recording(computed, token_stats)  # the policy's forward calls it for the head
        losses = [learner.train_step(batch, step)["loss"] for step in range(2)
                  for batch in learner.prepare(make_samples("ppo"))]
        lm_head.token_stats = token_stats
        states = [value for state in learner.optimizer.state.values() for value in state.values()]
        report[name] = {"losses": losses, "head": computed[0],
                        "stepped": sorted({str(p.dtype) for p in learner.policy.parameters()}),
                        "moments": sorted({str(v.dtype) for v in states if v.dim() > 0})}
    compose.mixed_precision_policy = original
    return report


def worker(model: str, out: str, checkpoints: str, tp: int) -> None:
    import torch

    torch.set_num_threads(1)
    from trainer.parallel import init_distributed, shutdown_distributed

    env = init_distributed("cpu", tp=tp)
    root = Path(checkpoints)
    results = {"loading": loading_report(model, env), "tied": tied_report(root / f"tied{env.world_size}", env),
               "losses": run_steps(model, env, tp, root / f"world{env.world_size}"),
               "resumed": run_steps(model, env, tp, root / f"world{env.world_size}", resume_from=root / "world1"),
               "mixed_precision": mixed_precision_report(model, env, tp),
               "repeated_save": repeated_save_report(model, env, tp, root / f"repeated{env.world_size}")}
    if env.is_main:
        Path(out).write_text(json.dumps(results))
    shutdown_distributed(env)


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """The reference: one process trains every algorithm (and checkpoints after SAVE_AT)."""
    import torch

    from trainer.parallel import DistEnv

    checkpoints = tmp_path_factory.mktemp("tp-checkpoints")
    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    return checkpoints, run_steps(str(tiny_model_dir), env, 1, checkpoints / "world1")


def run_torchrun(procs: int, tp: int, model, checkpoints: Path, port: int) -> dict:
    out = checkpoints / f"torchrun-{procs}.json"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs),
                "--master_addr", "127.0.0.1", "--master_port", str(port)]
    script = [str(Path(__file__)), "--model", str(model), "--checkpoints", str(checkpoints), "--tp", str(tp)]
    _run([*torchrun, *script, "--out", str(out)], checkpoints, timeout=480)
    return json.loads(out.read_text())


def check_against_one_process(parallel: dict, procs: int, model, checkpoints: Path, single: dict) -> None:
    import torch

    from trainer.parallel import DistEnv

    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    # This process resumes from the torchrun checkpoint; torchrun resumed from this process's.
    again = checkpoints / f"again{procs}"
    resumed_here = run_steps(str(model), env, 1, again, resume_from=checkpoints / f"world{procs}")
    for name in RUNS:
        steps = len(single[name])
        assert steps > STEPS - 1 and len(parallel["losses"][name]) == steps, name
        assert abs(single[name][-1] - single[name][0]) > 1e-3, f"{name}: the loss does not move"
        np.testing.assert_allclose(parallel["losses"][name], single[name], rtol=0, atol=1e-5, err_msg=name)
        for resumed in (parallel["resumed"][name], resumed_here[name]):
            assert 0 < len(resumed) < steps, name
            np.testing.assert_allclose(resumed, single[name][-len(resumed):], rtol=0, atol=1e-6, err_msg=name)
        expected = torch.load(checkpoints / "world1" / f"{name}-trained-weights.pt")
        for tag, folder in (("trained", f"world{procs}"), ("resumed", f"world{procs}"), ("resumed", again.name)):
            weights = torch.load(checkpoints / folder / f"{name}-{tag}-weights.pt")
            assert sorted(weights) == sorted(expected), name
            for key, value in expected.items():
                torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-5, msg=f"{name} {tag} {folder} {key}")


def check_loading(loading: dict, procs: int) -> None:
    assert loading["same_names"] and loading["max_diff"] == 0.0
    assert len(loading["per_rank"]) == procs
    for rank in loading["per_rank"]:
        # Each rank reads and holds about its share of the model (replicated norms and biases aside), never all.
        assert rank["read"] < 0.6 * loading["model_bytes"], loading
        assert rank["held"] <= rank["read"] + 1024, loading


@pytest.fixture(scope="module")
def tp2(tiny_model_dir, one_process, tmp_path_factory):
    """The same under torchrun: 2 processes, tp 2."""
    import socket

    checkpoints, _ = one_process
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return run_torchrun(2, 2, tiny_model_dir, checkpoints, port)


def test_tp2_loads_only_each_ranks_shards(tp2):
    check_loading(tp2["loading"], 2)
    assert tp2["tied"] == {"shared": True, "head_saved": False, "max_diff": 0.0}


def test_tp2_losses_weights_and_dcp_resumes_equal_one_process(tiny_model_dir, one_process, tp2):
    checkpoints, single = one_process
    check_against_one_process(tp2, 2, tiny_model_dir, checkpoints, single)


def test_tp2_a_step_saved_twice_commits_once(tp2):
    assert tp2["repeated_save"] == {"step": 5, "folders": ["latest", "step_00000005"]}


def test_tp2_mixed_precision_computes_in_bf16_and_steps_fp32_masters(tp2):
    report = tp2["mixed_precision"]
    assert report["float32"]["head"] == ["torch.float32", "torch.float32"]
    assert report["bfloat16"]["head"] == ["torch.bfloat16", "torch.bfloat16"]
    for run in report.values():
        assert run["stepped"] == ["torch.float32"] and run["moments"] == ["torch.float32"]
    # bf16 rounding, not another computation: the first step's loss and the second's (after an update from
    # gradients reduced in float32) agree.
    np.testing.assert_allclose(report["bfloat16"]["losses"], report["float32"]["losses"], rtol=0, atol=5e-3)
    assert report["bfloat16"]["losses"] != report["float32"]["losses"]


@pytest.mark.slow
def test_dp2_tp2_loads_shards_and_trains_as_one_process(tiny_model_dir, one_process, free_port):
    checkpoints, single = one_process
    parallel = run_torchrun(4, 2, tiny_model_dir, checkpoints, free_port)
    check_loading(parallel["loading"], 4)
    for rank in parallel["loading"]["per_rank"]:
        assert rank["read"] < 0.35 * parallel["loading"]["model_bytes"]
    check_against_one_process(parallel, 4, tiny_model_dir, checkpoints, single)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--tp", type=int, required=True)
    args = parser.parse_args()
    worker(args.model, args.out, args.checkpoints, args.tp)
