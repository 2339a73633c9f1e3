"""The training loop against a real buffer process: ack after the step, publish, checkpoint, resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from protos import buffer_pb2, buffer_pb2_grpc
from protos.sample import Sample
from services.client import connect_sync

ROOT = Path(__file__).resolve().parents[1]
BATCH = 8
GROUP = 4


def make_samples(count: int, prefix: str = "s") -> list[Sample]:
    rng = np.random.default_rng(5)
    samples = []
    for i in range(count):
        length = 3 + i % 4
        samples.append(
            Sample(
                sample_id=f"{prefix}{i}",
                prompt_id=f"{prefix}p{i // GROUP}",
                group_size=GROUP,
                prompt_ids=np.array([1, 20 + i % 10], dtype=np.int32),
                response_ids=rng.integers(3, 90, length).astype(np.int32),
                loss_mask=np.ones(length, dtype=np.uint8),
                rollout_logprobs=np.full(length, -4.6, dtype=np.float32),
                weight_versions=np.zeros(length, dtype=np.int64),
                reward=float(rng.integers(0, 2)),
            )
        )
    return samples


def put(address: str, samples: list[Sample]) -> None:
    with connect_sync(address) as channel:
        reply = buffer_pb2_grpc.BufferStub(channel).Put(
            buffer_pb2.PutRequest(samples=[s.to_proto() for s in samples]), timeout=30
        )
    assert reply.accepted == len(samples)


def stats(address: str) -> buffer_pb2.StatsResponse:
    with connect_sync(address) as channel:
        return buffer_pb2_grpc.BufferStub(channel).Stats(buffer_pb2.StatsRequest(), timeout=10)


def trainer_overrides(model: Path, address: str, tmp_path: Path, max_steps: int, **extra: str) -> list[str]:
    fields = {
        "model_path": str(model),
        "buffer.address": address,
        "buffer.max_wait_s": "60",
        "batch.global_batch_size": str(BATCH),
        "batch.micro_batch_size": "4",
        "optim.lr": "1e-3",
        "max_steps": str(max_steps),
        "checkpoint.dir": str(tmp_path / "checkpoints"),
        "metrics_sample_ids": "true",
        **extra,
    }
    return [arg for key, value in fields.items() for arg in ("--set", f"{key}={value}")]


def start_trainer(overrides: list[str], log_path: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-m", "trainer", *overrides], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize(
    ("overlap", "bind"), [(False, True), (True, True), (True, False), (False, False)],
    ids=["publish-bound", "overlapped-publish-of-snapshots", "overlapped-publish-gathered", "publish-gathered-per-bucket"],
)
def test_trains_from_the_buffer_acks_publishes_and_exports(tiny_model_dir, tmp_path, service_factory, overlap, bind):
    from transformers import AutoModelForCausalLM

    from protos import rollout_pb2, rollout_pb2_grpc
    from protos.codec import decode_array, encode_array
    from trainer.buffer_client import BufferClient
    from trainer.config import TrainerConfig
    from trainer.loop import train
    from trainer.parallel import init_distributed
    from trainer.run import RolloutPublisher

    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    rollout = service_factory("rollout", {"model": str(tiny_model_dir)})
    put(buffer.address, make_samples(3 * BATCH))
    config = TrainerConfig.model_validate(
        {
            "model_path": str(tiny_model_dir),
            "buffer": {"address": buffer.address, "max_wait_s": 30},
            "batch": {"global_batch_size": BATCH, "micro_batch_size": 4},
            "optim": {"lr": 1e-2},
            "max_steps": 2,
            "publish": {"receivers": [rollout.address], "timeout_s": 30, "overlap": overlap, "bind": bind},
            "metrics_path": str(tmp_path / "metrics.jsonl"),
            "checkpoint": {"dir": str(tmp_path / "checkpoints"), "export_dir": str(tmp_path / "export")},
        }
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    client, publisher = BufferClient(config.buffer), RolloutPublisher(config.publish)
    try:
        state = train(config, init_distributed("cpu"), client, publisher)
        # Bound: every publish went out straight from the parameters' (or the snapshot's) memory, unpacked.
        packing_buffers = publisher._broadcaster.broadcaster._transport._sender._buffers
        assert (packing_buffers == []) == bind, packing_buffers
    finally:
        client.close()
        publisher.close()
        torch.set_num_threads(threads)

    assert (state.step, state.weight_version, state.samples_trained) == (2, 2, 2 * BATCH)
    after = stats(buffer.address)
    assert (after.acked, after.pending, after.leased, after.trainer_version) == (2 * BATCH, BATCH, 0, 2)
    steps = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in steps] == [1, 2]
    # Each step reports the last publish that ended: its sync time and, apart from it, how long the engine paused.
    assert steps[0]["sync_s"] == steps[0]["pause_s"] == 0.0  # nothing published before the first step
    if not overlap:  # (an overlapped publish may still be on its way when the next step reports)
        assert 0 < steps[1]["pause_s"] <= steps[1]["sync_s"] and steps[1]["sync_s"] <= steps[1]["publish_s"]
    assert (tmp_path / "checkpoints" / "step_00000002").is_dir()

    # The rollout worker now serves the trained weights: its logprobs are the exported model's.
    prompt = [1, 20, 30, 40]
    with connect_sync(rollout.address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        params = rollout_pb2.SamplingParams(temperature=0, max_tokens=6, logprobs=True, ignore_eos=True)
        reply = stub.Generate(rollout_pb2.GenerateRequest(prompt_ids=encode_array(prompt, "int32"), params=params), timeout=60)
    completion = reply.completions[0]
    tokens = decode_array(completion.token_ids).tolist()
    assert decode_array(completion.weight_versions).tolist() == [2] * len(tokens)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export", dtype=torch.float32)
    with torch.no_grad():
        log_probs = torch.log_softmax(exported(torch.tensor([prompt + tokens])).logits[0], dim=-1)
    expected = [log_probs[len(prompt) - 1 + j, token].item() for j, token in enumerate(tokens)]
    np.testing.assert_allclose(decode_array(completion.logprobs), expected, rtol=0, atol=1e-5)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        assert not torch.allclose(original(torch.tensor([prompt])).logits, exported(torch.tensor([prompt])).logits)


@pytest.mark.slow
def test_killed_trainer_resumes_and_trains_no_sample_twice(tiny_model_dir, tmp_path, service_factory):
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "lease_timeout_s": 2.0})
    put(buffer.address, make_samples(24 * BATCH))
    max_steps, interval = 16, 2
    overrides = trainer_overrides(tiny_model_dir, buffer.address, tmp_path, max_steps, **{"checkpoint.interval": str(interval)})
    first_metrics, second_metrics = tmp_path / "first.jsonl", tmp_path / "second.jsonl"

    first = start_trainer([*overrides, "--set", f"metrics_path={first_metrics}"], tmp_path / "first.log")
    latest = tmp_path / "checkpoints" / "latest"
    deadline = time.monotonic() + 120
    while not (latest.exists() and latest.read_text() >= "step_00000004"):
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint at step 4 within 120 s"
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    killed_at = len(records(first_metrics))
    assert killed_at < max_steps, "the first run finished before it could be killed"

    second = start_trainer([*overrides, "--set", f"metrics_path={second_metrics}"], tmp_path / "second.log")
    assert second.wait(180) == 0, (tmp_path / "second.log").read_text()[-3000:]
    resumed_from = records(second_metrics)[0]["step"] - 1
    assert resumed_from >= 4 and resumed_from % interval == 0
    assert "resumed from" in (tmp_path / "second.log").read_text()

    # The final model's lineage: the first run up to its checkpoint, then the second run.
    lineage = [r for r in records(first_metrics) if r["step"] <= resumed_from] + records(second_metrics)
    assert [r["step"] for r in lineage] == list(range(1, max_steps + 1))
    trained = [sample_id for r in lineage for sample_id in r["sample_ids"]]
    assert len(trained) == len(set(trained)) == max_steps * BATCH
    # Batches acked by the first run (those its checkpoint holds: acks wait for the checkpoint) were never
    # trained again by the second one.
    acked_by_first = {sample_id for r in records(first_metrics) if r["step"] <= resumed_from for sample_id in r["sample_ids"]}
    assert not acked_by_first & {sample_id for r in records(second_metrics) for sample_id in r["sample_ids"]}
    after = stats(buffer.address)
    assert after.leased == 0 and after.acked + after.pending == 24 * BATCH
