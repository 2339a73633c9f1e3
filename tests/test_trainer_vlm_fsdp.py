"""FSDP2 over both towers of a vision-language policy: under `torchrun --nproc_per_node 2` (gloo) the sharded
Qwen2.5-VL (each decoder layer and each vision block an FSDP unit, loaded shard by shard from the folder's
checkpoint names) scores image samples, back-propagates into both towers and publishes both (`model.freeze_vision`
false) as one process does, within 1e-5.

The test runs this file as a script: under torchrun, then as a plain process; each run writes what it saw to JSON.
"""

import argparse
import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
from test_trainer_parallel import _run

ROOT = Path(__file__).resolve().parents[1]
LR = 0.05


def worker(model: str, samples_file: str, out: str) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    from trainer.batch import collate
    from trainer.broadcast.gather import ShardedWeights
    from trainer.checkpoint import hf_state_dict
    from trainer.config.model import ModelConfig
    from trainer.config.parallel import ParallelConfig
    from trainer.model import run_policy
    from trainer.parallel import init_distributed, shutdown_distributed
    from trainer.parallel.loading import build_policy

    env = init_distributed("cpu")
    policy = build_policy(model, env, ParallelConfig(), ModelConfig(freeze_vision=False))
    samples = pickle.loads(Path(samples_file).read_bytes())
    batch = collate(samples, vision=policy.vision)
    out_ = run_policy(policy, batch.input_ids, batch.attention_mask, images=batch.images)
    mask = batch.attention_mask[:, 1:].bool()
    (-(out_.logprobs * mask).sum()).backward()  # every rank the whole batch: the averaged gradient is the batch's

    def whole(tensor):
        return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor

    grads = {name: float(whole(p.grad).double().norm()) for name, p in policy.named_parameters()}
    with torch.no_grad():
        for p in policy.parameters():
            p.sub_(LR * p.grad)
    published = ShardedWeights(hf_state_dict(policy.state_dict(), False), env.device).gathered_copy(keep=env.is_main)
    if env.is_main:
        Path(out).write_text(json.dumps({
            "sharded": {name: type(p).__name__ for name, p in policy.named_parameters()},
            "logprobs": out_.logprobs[mask].tolist(), "grads": grads,
            "published": {name: float(t.double().sum()) for name, t in published.items()}}))
    shutdown_distributed(env)


@pytest.mark.slow
def test_a_sharded_vlm_policy_equals_one_process(tmp_path, free_port):
    from test_trainer_vlm import engine_samples

    from rollout.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "vlm", arch="qwen2_5_vl", seed=7)
    samples = tmp_path / "samples.pkl"
    samples.write_bytes(pickle.dumps(engine_samples(model)))
    script = [str(Path(__file__)), "--model", str(model), "--samples", str(samples)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                "--master_addr", "127.0.0.1", "--master_port", str(free_port)]
    _run([*torchrun, *script, "--out", str(tmp_path / "fsdp.json")], tmp_path, timeout=400)
    _run([sys.executable, *script, "--out", str(tmp_path / "single.json")], tmp_path, timeout=400)
    fsdp, single = (json.loads((tmp_path / f"{run}.json").read_text()) for run in ("fsdp", "single"))
    # both towers sharded: a vision block's and a decoder layer's parameters are DTensors
    assert fsdp["sharded"]["lm.model.visual.blocks.0.attn.qkv.weight"] == "DTensor"
    assert fsdp["sharded"]["lm.model.language_model.layers.0.mlp.up_proj.weight"] == "DTensor"
    assert single["sharded"]["lm.model.visual.blocks.0.attn.qkv.weight"] == "Parameter"
    np.testing.assert_allclose(fsdp["logprobs"], single["logprobs"], rtol=0, atol=1e-5)
    assert fsdp["grads"].keys() == single["grads"].keys()
    for name, norm in single["grads"].items():
        assert abs(fsdp["grads"][name] - norm) <= 1e-5 * max(1.0, norm), name
    assert single["grads"]["lm.model.visual.blocks.0.attn.qkv.weight"] > 0  # the tower learns (freeze_vision false)
    # the publish carries both towers, the vision weights as stepped
    assert fsdp["published"].keys() == single["published"].keys()
    assert any(name.startswith("model.visual.") for name in fsdp["published"])
    for name, total in single["published"].items():
        assert abs(fsdp["published"][name] - total) <= 1e-4 * max(1.0, abs(total)), name


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker(args.model, args.samples, args.out)
