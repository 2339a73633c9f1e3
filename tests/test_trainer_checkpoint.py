"""Checkpoints resume the exact run; export writes a Hugging Face folder that loads and agrees."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from protos.sample import Sample
from trainer.checkpoint import TrainState, export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.parallel import DistEnv

ENV = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))


def make_samples(count=4):
    rng = np.random.default_rng(11)
    return [
        Sample(
            sample_id=f"s{i}",
            prompt_id=f"p{i // 2}",
            group_size=2,
            prompt_ids=np.r_[1, rng.integers(3, 90, 2)].astype(np.int32),
            response_ids=rng.integers(3, 90, 4 + i).astype(np.int32),
            loss_mask=np.ones(4 + i, dtype=np.uint8),
            rollout_logprobs=np.full(4 + i, -4.0, dtype=np.float32),
            weight_versions=np.zeros(4 + i, dtype=np.int64),
            reward=float(i),
        )
        for i in range(count)
    ]


def learner_for(model, algorithm="grpo") -> Learner:
    config = TrainerConfig(
        model_path=str(model), algorithm={"name": algorithm}, optim={"lr": 3e-3},
        batch={"global_batch_size": 4, "micro_batch_size": 2},
    )
    return Learner(config, ENV)


def step(learner: Learner, state: TrainState) -> float:
    (mini_batch,) = learner.prepare(make_samples())
    loss = learner.train_step(mini_batch, state.step)["loss"]
    state.step += 1
    state.weight_version += 1
    state.samples_trained += 4
    return loss


def test_resume_continues_the_same_run(tiny_model_dir, tmp_path):
    learner, state = learner_for(tiny_model_dir, "ppo"), TrainState(extra={"acked_leases": 2})
    step(learner, state)
    step(learner, state)
    path = save_checkpoint(tmp_path, learner.policy, learner.optimizer, state, ENV)
    expected_next = step(learner, state)

    resumed = learner_for(tiny_model_dir, "ppo")
    assert latest_checkpoint(tmp_path) == path
    restored = load_checkpoint(path, resumed.policy, resumed.optimizer, ENV)
    assert restored == TrainState(step=2, weight_version=2, samples_trained=8, extra={"acked_leases": 2})
    assert step(resumed, restored) == pytest.approx(expected_next, abs=1e-6)
    for (name, mine), theirs in zip(resumed.policy.state_dict().items(), learner.policy.state_dict().values(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6, msg=name)


def test_latest_is_replaced_atomically_and_old_checkpoints_pruned(tiny_model_dir, tmp_path):
    learner = learner_for(tiny_model_dir)
    for number in (1, 2, 3):
        save_checkpoint(tmp_path, learner.policy, learner.optimizer, TrainState(step=number), ENV, keep_last=2)
    (tmp_path / ".tmp-step_00000004-999").mkdir()  # a save that crashed half-way
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    assert latest_checkpoint(tmp_path).name == "step_00000003"
    assert json.loads((tmp_path / "step_00000003" / "state.json").read_text())["step"] == 3
    assert latest_checkpoint(tmp_path / "nothing-here") is None
    (tmp_path / "latest").write_text("step_00000009")
    with pytest.raises(FileNotFoundError, match="step_00000009"):
        latest_checkpoint(tmp_path)


@pytest.mark.parametrize("tied", [False, True])
def test_export_is_a_hugging_face_folder_with_the_trained_weights(tiny_model_dir, tmp_path, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "tied", tie_word_embeddings=True) if tied else tiny_model_dir
    learner = learner_for(model, "ppo")
    step(learner, TrainState())
    out = export_hf(tmp_path / "export", learner.policy, model, ENV)

    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert not any(name.startswith("value_head") for name in names)
    assert ("lm_head.weight" in names) != tied
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, learner.policy.lm(input_ids=ids).logits, rtol=0, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer.encode("12+7=19")) == "12+7=19"


def test_a_moe_export_names_each_expert_and_loads_back(tmp_path):
    """A mixture-of-experts policy (fused experts tensors in the trainer) exports under per-expert names, as the
    Hub's checkpoints hold them; transformers loads the folder to the same forward."""
    from transformers import AutoModelForCausalLM

    from rollout.model.tiny import write_tiny_model
    from trainer.model import load_policy

    model = write_tiny_model(tmp_path / "moe", arch="qwen3_moe", hidden_size=64, num_heads=2, num_kv_heads=1,
                             num_experts=4)
    policy = load_policy(model)
    with torch.no_grad():  # weights that differ from the folder's
        for parameter in policy.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
    out = export_hf(tmp_path / "export", policy, model, ENV)
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in names)
    assert {f"model.layers.1.mlp.experts.3.{kind}.weight" for kind in ("gate_proj", "up_proj", "down_proj")} <= names
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, policy.lm(input_ids=ids).logits, rtol=0, atol=1e-5)


def test_a_crashed_runs_folder_that_never_became_latest_is_replaced(tiny_model_dir, tmp_path):
    """A run saved step 2 and died before `latest` named it; the resumed run reaches step 2 again: its own
    state is saved (the acks that follow must rest on it), not skipped as already there."""
    learner = learner_for(tiny_model_dir)
    save_checkpoint(tmp_path, learner.policy, learner.optimizer, TrainState(step=1), ENV)
    stale = tmp_path / "step_00000002"
    stale.mkdir()
    (stale / "state.json").write_text(json.dumps({"step": 2, "weight_version": 99}))
    save_checkpoint(tmp_path, learner.policy, learner.optimizer, TrainState(step=2, weight_version=2), ENV)
    assert latest_checkpoint(tmp_path) == stale
    assert load_checkpoint(stale, learner.policy, learner.optimizer, ENV).weight_version == 2


def test_a_checkpoint_is_sharded_and_exports_to_hugging_face(tiny_model_dir, tmp_path):
    """The folder is a torch.distributed.checkpoint (shards + .metadata); export_checkpoint_hf reads it alone."""
    from safetensors.torch import load_file

    from trainer.checkpoint import MODEL_FILE, export_checkpoint_hf

    learner, state = learner_for(tiny_model_dir, "ppo"), TrainState()
    step(learner, state)
    path = save_checkpoint(tmp_path / "ckpt", learner.policy, learner.optimizer, state, ENV)
    assert (path / ".metadata").exists() and list(path.glob("*.distcp")) and not (path / MODEL_FILE).exists()
    out = export_checkpoint_hf(path, tiny_model_dir, tmp_path / "export")
    exported = load_file(out / "model.safetensors")
    trained = {name.removeprefix("lm."): t for name, t in learner.policy.state_dict().items() if name.startswith("lm.")}
    assert sorted(exported) == sorted(trained)
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, trained[name], rtol=0, atol=0, msg=name)


def test_a_checkpoint_of_the_format_before_dcp_still_resumes(tiny_model_dir, tmp_path):
    """Folders written before DCP (rank 0's whole state dicts in model.pt and optimizer.pt) load as they did."""
    from trainer.checkpoint import LATEST_FILE, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE
    from trainer.parallel import gather_model_state, gather_optimizer_state

    learner, state = learner_for(tiny_model_dir, "ppo"), TrainState()
    step(learner, state)
    path = tmp_path / "step_00000001"
    path.mkdir()
    torch.save(gather_model_state(learner.policy, ENV), path / MODEL_FILE)
    torch.save(gather_optimizer_state(learner.policy, learner.optimizer, ENV), path / OPTIMIZER_FILE)
    (path / STATE_FILE).write_text(json.dumps({"step": 1, "weight_version": 1, "samples_trained": 4, "extra": {}}))
    (tmp_path / LATEST_FILE).write_text(path.name)
    expected_next = step(learner, state)

    resumed = learner_for(tiny_model_dir, "ppo")
    restored = load_checkpoint(latest_checkpoint(tmp_path), resumed.policy, resumed.optimizer, ENV)
    assert restored.step == 1
    assert step(resumed, restored) == pytest.approx(expected_next, abs=1e-6)
    for (name, mine), theirs in zip(resumed.policy.state_dict().items(), learner.policy.state_dict().values(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6, msg=name)  # the optimizer's moments came back too
