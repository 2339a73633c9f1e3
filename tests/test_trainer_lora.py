"""LoRA in the trainer (`model.lora`, trainer/lora.py): only the adapters (and PPO's value head) train, the reference
logprobs are the same model's with its adapters off, checkpoints hold the adapters, and the export is a merged
Hugging Face folder plus a PEFT adapter folder. The torchrun test runs this file as a script: FSDP2 over 2 gloo
ranks, and TP 2 (the plan follows the wrapped projections' base_layer), each equal to one process within 1e-5.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer_parallel import _run, make_samples

LORA = {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}
RUNS = {
    "grpo-kl": {"algorithm": {"name": "grpo", "off_policy": "tis", "kl_coef": 0.05}},
    "ppo": {"algorithm": {"name": "ppo"}, "batch": {"mini_batches": 2, "micro_batch_size": 2}},
}
STEPS = 3


def _config(model, overrides: dict, **extra):
    from trainer.config import TrainerConfig

    return TrainerConfig.model_validate({
        "model_path": str(model), "optim": {"lr": 5e-3, "eps": 1e-4}, "algorithm": overrides["algorithm"],
        "batch": {"global_batch_size": 8, "micro_batch_size": 4, **overrides.get("batch", {})},
        "model": {"lora": LORA}, **extra,
    })  # fmt: skip


def run_steps(model: str, env, tp: int = 1) -> dict[str, list[float]]:
    from trainer.learner import Learner

    results = {}
    for name, overrides in RUNS.items():
        learner = Learner(_config(model, overrides, parallel={"tp": tp}), env)
        samples = make_samples(overrides["algorithm"]["name"])
        results[name] = [learner.train_step(batch, step)["loss"] for step in range(STEPS)
                         for batch in learner.prepare(samples)]
    return results


def test_only_the_adapter_trains_and_the_reference_is_the_base(tiny_model_dir):
    from trainer.learner import Learner
    from trainer.lora import is_adapter
    from trainer.model import load_policy, run_policy
    from trainer.parallel import DistEnv

    learner = Learner(_config(tiny_model_dir, RUNS["grpo-kl"]), DistEnv(0, 1, torch.device("cpu")))
    trainable = {name for name, p in learner.policy.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(name) for name in trainable)
    assert learner.reference is None  # no second model
    base = {name: p.detach().clone() for name, p in learner.policy.named_parameters() if not is_adapter(name)}
    samples = make_samples("grpo")
    for step in range(2):
        for batch in learner.prepare(samples):
            learner.train_step(batch, step)
    after = dict(learner.policy.named_parameters())
    assert all(torch.equal(after[name], tensor) for name, tensor in base.items())  # the base never moves
    assert any(float(p.detach().abs().max()) > 0 for name, p in after.items() if name.endswith("lora_B.weight"))

    batch = learner.prepare(samples)[0]
    plain = load_policy(tiny_model_dir)
    with torch.no_grad():
        expected = run_policy(plain, batch.input_ids, batch.attention_mask, batch.temperatures).logprobs
        adapted = run_policy(learner.policy, batch.input_ids, batch.attention_mask, batch.temperatures).logprobs
    mask = batch.loss_mask[:, : expected.shape[1]] > 0
    np.testing.assert_allclose(batch.ref_logprobs[:, : expected.shape[1]][mask], expected[mask], rtol=0, atol=1e-6)
    assert float((adapted - expected)[mask].abs().max()) > 1e-3  # the adapter did move the policy


def test_ppo_trains_the_value_head_too(tiny_model_dir):
    from trainer.learner import Learner
    from trainer.parallel import DistEnv

    learner = Learner(_config(tiny_model_dir, RUNS["ppo"]), DistEnv(0, 1, torch.device("cpu")))
    trainable = {name for name, p in learner.policy.named_parameters() if p.requires_grad}
    assert {"value_head.weight", "value_head.bias"} <= trainable
    assert not any("base_layer" in name or "embed" in name for name in trainable)


def test_checkpoint_and_export_hold_the_adapter(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint import (
        TrainState,
        export_checkpoint_hf,
        export_hf,
        latest_checkpoint,
        load_checkpoint,
        read_model_state,
        save_checkpoint,
    )
    from trainer.learner import Learner
    from trainer.model import PolicyModel, run_policy
    from trainer.parallel import DistEnv

    env = DistEnv(0, 1, torch.device("cpu"))
    learner = Learner(_config(tiny_model_dir, RUNS["grpo-kl"]), env)
    samples = make_samples("grpo")
    for batch in learner.prepare(samples):
        learner.train_step(batch, 0)
    save_checkpoint(tmp_path / "ckpt", learner.policy, learner.optimizer, TrainState(step=1), env)
    saved = read_model_state(next((tmp_path / "ckpt").glob("step_*")))
    state = learner.policy.state_dict()
    adapters = [name for name in state if "lora_" in name]
    assert adapters and all(torch.equal(saved[name], state[name]) for name in adapters)

    out = export_hf(tmp_path / "export", learner.policy, tiny_model_dir, env)
    peft_file = load_file(out / "adapter" / "adapter_model.safetensors")
    peft_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert peft_config["r"] == 4 and peft_config["lora_alpha"] == 8.0 and peft_config["peft_type"] == "LORA"
    assert set(peft_config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"}
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in peft_file
    merged = PolicyModel(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)).eval()
    batch = learner.prepare(samples)[0]
    with torch.no_grad():
        want = run_policy(learner.policy, batch.input_ids, batch.attention_mask).logprobs
        got = run_policy(merged, batch.input_ids, batch.attention_mask).logprobs
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    # The adapter folder is peft's own: PeftModel loads it over the base and computes what the trained policy does.
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with_adapter = PolicyModel(PeftModel.from_pretrained(base, out / "adapter").merge_and_unload()).eval()
    with torch.no_grad():
        from_peft = run_policy(with_adapter, batch.input_ids, batch.attention_mask).logprobs
    np.testing.assert_allclose(from_peft, want, rtol=0, atol=1e-5)

    again = export_checkpoint_hf(next((tmp_path / "ckpt").glob("step_*")), tiny_model_dir, tmp_path / "again",
                                 (8.0, 0.0))
    first, second = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    with pytest.raises(ValueError, match="LoRA checkpoint"):
        export_checkpoint_hf(next((tmp_path / "ckpt").glob("step_*")), tiny_model_dir, tmp_path / "bad")

    resumed = Learner(_config(tiny_model_dir, RUNS["grpo-kl"]), env)  # a fresh adapter, then the checkpoint's
    load_checkpoint(latest_checkpoint(tmp_path / "ckpt"), resumed.policy, resumed.optimizer, env)
    losses = [model.train_step(model.prepare(samples)[0], 1)["loss"] for model in (learner, resumed)]
    assert losses[0] == pytest.approx(losses[1], abs=1e-6)  # the adapter and its Adam moments came back


def test_unknown_target_is_refused(tiny_model_dir):
    from trainer.learner import Learner
    from trainer.parallel import DistEnv

    config = _config(tiny_model_dir, RUNS["grpo-kl"]).model_copy(deep=True)
    config.model.lora.target_modules = ["q_proj", "qkv"]
    with pytest.raises(ValueError, match=r"no linear layer named \['qkv'\]"):
        Learner(config, DistEnv(0, 1, torch.device("cpu")))


@pytest.mark.ranks
def test_fsdp_and_tp_follow_one_process(tiny_model_dir, tmp_path, free_port):
    from trainer.parallel import DistEnv

    single = run_steps(str(tiny_model_dir), DistEnv(0, 1, torch.device("cpu")))
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}.json"
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
              "--master_port", str(free_port + tp), str(Path(__file__)), "--model", str(tiny_model_dir),
              "--out", str(out), "--tp", str(tp)], tmp_path)
        ranks = json.loads(out.read_text())
        for name in RUNS:
            assert len(ranks[name]) == len(single[name]) > 0, name
            np.testing.assert_allclose(ranks[name], single[name], rtol=0, atol=1e-5, err_msg=f"{name} tp={tp}")


def worker(model: str, out: str, tp: int) -> None:
    torch.set_num_threads(1)
    from trainer.parallel import init_distributed, shutdown_distributed

    env = init_distributed("cpu", tp=tp)
    results = run_steps(model, env, tp)
    if env.is_main:
        Path(out).write_text(json.dumps(results))
    shutdown_distributed(env)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    args = parser.parse_args()
    worker(args.model, args.out, args.tp)
