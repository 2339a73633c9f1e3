"""Expert parallelism: a tiny Qwen3-MoE's experts split over 2 (and 4) gloo ranks, tokens dispatched by all-to-all,
with routing replay (R3) on, follows one process: losses and the updated weights within 1e-5. The 2-rank run also
saves a DCP checkpoint that one process (ep 1) resumes and continues the same curve.

The test runs this file as a script: under `torchrun --nproc_per_node N` with parallel.ep, then as a plain process;
each writes its losses and its final weights (gathered whole, trainer/parallel/state.py).
"""

import argparse
import json
import sys
from pathlib import Path

import pytest
from test_moe_replay_ranks import make_samples
from test_trainer_parallel import _run

STEPS = 3
SAVE_AT = 2


# The 4-rank run's variant: packed rows and checkpointed layers (a recomputed layer redoes its all-to-alls).
PACKED = {"batch": {"micro_batch_size": 4, "max_tokens_per_micro_batch": 30, "packing": True},
          "model": {"activation_checkpointing": True}}


def train(model: str, env, checkpoints: str, resume: bool, packed: bool = False) -> tuple[list, object]:
    """STEPS steps of GRPO with routing replay on the fixed batch (from the checkpoint's step when `resume`); each
    step's [loss, grad_norm], and the learner. A run with ep > 1 saves a checkpoint after step SAVE_AT."""
    from trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
    from trainer.config import TrainerConfig
    from trainer.learner import Learner

    config = TrainerConfig.model_validate({
        "model_path": model, "optim": {"lr": 2e-3}, "algorithm": {"name": "grpo", "off_policy": "tis"},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2, **(PACKED["batch"] if packed else {})},
        "model": PACKED["model"] if packed else {}, "parallel": {"ep": env.ep_size}, "moe": {"routing_replay": "rollout"}})
    learner = Learner(config, env)
    state = TrainState()
    if resume:
        state = load_checkpoint(latest_checkpoint(checkpoints), learner.policy, learner.optimizer, env)
    steps = []
    while state.step < STEPS:
        for mini_batch in learner.prepare(make_samples()):
            result = learner.train_step(mini_batch, state.step)
            steps.append([result["loss"], result["grad_norm"]])
            state.step += 1
        if state.step == SAVE_AT and env.ep_size > 1 and checkpoints:
            save_checkpoint(Path(checkpoints), learner.policy, learner.optimizer, state, env)
    return steps, learner


def worker(model: str, out: str, ep: int, checkpoints: str, publish: bool, packed: bool) -> None:
    """Train, write the steps' figures and the final weights (gathered whole); one process given `checkpoints`
    then also resumes from the ep run's checkpoint (ep 2 -> 1). `publish`: rank 0 then publishes the policy, as the
    trainer does (trainer/publishing.py), to a native engine served in its process. `packed`: the PACKED variant."""
    import torch

    torch.set_num_threads(1)
    from safetensors.torch import save_file

    from trainer.parallel import gather_model_state, init_distributed, shutdown_distributed

    env = init_distributed("cpu", ep=ep)
    steps, learner = train(model, env, checkpoints, resume=False, packed=packed)
    results = {"steps": steps}
    weights = gather_model_state(learner.policy, env)
    if not env.distributed and checkpoints:
        results["resumed"] = train(model, env, checkpoints, resume=True)[0]
    if publish:
        results["published"] = _publish(model, learner, env, weights)
    if env.is_main:
        Path(out).write_text(json.dumps(results))
        save_file({name: tensor.contiguous() for name, tensor in weights.items()}, f"{out}.safetensors")
    shutdown_distributed(env)


def _publish(model: str, learner, env, weights: dict) -> dict | None:
    """What the publish path sends (each expert tensor gathered whole under its fused name) through a real
    broadcast to a native engine: its report and the served tensors that differ from `weights` (rank 0)."""
    from test_weight_sync_gather import publish_to_engine

    from trainer.checkpoint import hf_state_dict, ties_embeddings
    from trainer.config.publish import PublishConfig
    from trainer.publishing import policy_weights

    source = policy_weights(learner, env, None, PublishConfig())()
    if not env.is_main:
        source.finish()
        return None
    return publish_to_engine(model, source, hf_state_dict(weights, ties_embeddings(learner.policy)))


def _tiny_moe(folder: Path) -> Path:
    """A tiny Qwen3-MoE (8 experts, top 2; one dense layer), saved as transformers saves it: per-expert names, which
    the sharded loader reads into the fused experts tensors (trainer/parallel/loading.py)."""
    from rollout.model.tiny import write_tiny_model

    return write_tiny_model(folder, arch="qwen3_moe", seed=7, num_layers=3, mlp_only_layers=(1,), hidden_size=64,
                            num_heads=2, num_kv_heads=1, num_experts=8)


def _compare(tmp_path: Path, free_port: int, ranks: int, ep: int, checkpoints: bool, publish: bool = False,
             packed: bool = False) -> None:
    import numpy as np
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = _tiny_moe(tmp_path / "moe")
    script = [str(Path(__file__)), "--model", str(model), *(["--packed"] if packed else [])]
    saved = ["--checkpoints", str(tmp_path / "ckpt")] if checkpoints else []
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_addr", "127.0.0.1", "--master_port", str(free_port)]
    published = ["--publish"] if publish else []
    _run([*torchrun, *script, "--ep", str(ep), *saved, *published, "--out", str(tmp_path / "ep.json")], tmp_path)
    _run([sys.executable, *script, *saved, "--out", str(tmp_path / "single.json")], tmp_path)
    ep_run, single_run = (json.loads((tmp_path / name).read_text()) for name in ("ep.json", "single.json"))
    ep_losses, single = ep_run["steps"], single_run["steps"]
    assert len(ep_losses) == len(single) == STEPS
    # Losses, and gradient norms (Adam's update hardly depends on the gradients' scale: the norm shows it whole).
    np.testing.assert_allclose(ep_losses, single, rtol=0, atol=1e-5)
    assert abs(single[-1][0] - single[0][0]) > 1e-3  # the loss moves: equal curves are no coincidence
    ep_weights, single_weights = (load_file(tmp_path / f"{name}.json.safetensors") for name in ("ep", "single"))
    assert ep_weights.keys() == single_weights.keys()
    experts = [name for name in single_weights if "experts" in name]
    assert experts and all(ep_weights[name].shape[0] == 8 for name in experts)  # whole, under the fused names
    initial = AutoModelForCausalLM.from_pretrained(model).state_dict()
    for name, tensor in single_weights.items():
        np.testing.assert_allclose(ep_weights[name].numpy(), tensor.numpy(), rtol=0, atol=1e-5, err_msg=name)
    assert all((single_weights[name] - initial[name.removeprefix("lm.")]).abs().max() > 1e-4  # the experts trained
               for name in experts)
    if publish:  # the engine serves the experts whole, as trained
        report = ep_run["published"]
        assert report["ok"], report["failed"]
        assert report["differ"] == [] and any("experts.gate_up_proj" in name for name in report["names"]), report
    if checkpoints:  # ep 2 -> one process (ep 1): the saved step resumes and continues the curve
        resumed = single_run["resumed"]
        assert len(resumed) == STEPS - SAVE_AT
        np.testing.assert_allclose(resumed, single[SAVE_AT:], rtol=0, atol=1e-5)


def test_what_expert_parallelism_refuses(tmp_path):
    """TP on a MoE model, ep with tp or pp, ep on a dense model or not dividing the experts, ep in one process: each a
    clear error."""
    from pydantic import ValidationError
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.model.tiny import write_tiny_model
    from trainer.config.parallel import ParallelConfig
    from trainer.parallel import init_distributed
    from trainer.parallel.ep import check_ep
    from trainer.parallel.tp import check_tp

    moe = _tiny_moe(tmp_path / "moe")
    with pytest.raises(ValueError, match="tensor parallelism does not split a mixture-of-experts"):
        check_tp(AutoConfig.from_pretrained(moe), 2)
    for split in ({"tp": 2}, {"pp": 2}):
        with pytest.raises(ValidationError, match="parallel.ep=2: not with parallel.tp > 1 or parallel.pp > 1"):
            ParallelConfig(ep=2, **split)
    with pytest.raises(ValueError, match="parallel.ep=3 does not divide the model's num_experts=8"):
        check_ep(AutoModelForCausalLM.from_pretrained(moe), 3)
    dense = AutoModelForCausalLM.from_pretrained(write_tiny_model(tmp_path / "dense", hidden_size=64, num_heads=2,
                                                                  num_kv_heads=1))
    with pytest.raises(ValueError, match="no experts modules"):
        check_ep(dense, 2)
    with pytest.raises(ValueError, match="start the trainer under torchrun"):
        init_distributed("cpu", ep=2)


def test_two_ranks_splitting_experts_follow_one_process(tmp_path, free_port):
    _compare(tmp_path, free_port, ranks=2, ep=2, checkpoints=True)


@pytest.mark.ranks
def test_four_ranks_two_expert_groups_follow_one_process(tmp_path, free_port):
    """dp 4 = edp 2 x ep 2: the experts' gradients also sum over the two ranks holding the same experts; with packed
    rows and checkpointed layers; the publish gathers each expert tensor whole for the engine."""
    _compare(tmp_path, free_port, ranks=4, ep=2, checkpoints=False, publish=True, packed=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--checkpoints", default="")
    parser.add_argument("--publish", action="store_true")
    parser.add_argument("--packed", action="store_true")
    args = parser.parse_args()
    worker(args.model, args.out, args.ep, args.checkpoints, args.publish, args.packed)
