"""The trainer's publish to a receiver whose engine joins the group itself (SGLang's way), on CPU over gloo.

The receiver is a real WeightSync service in its own process (tests/torch_group_member.py): the project's
WeightReceiver over an engine side that makes only the torch.distributed calls SGLang's scheduler makes to join
(init_weights_update_group) and receive (update_weights_from_distributed). It checks our side of that contract:
the BeginUpdate reply that asks for tensor broadcasts, the trainer's group formed as torch.distributed forms a
named group, one broadcast per tensor in manifest order, each in its dtype and shape, the group kept across
publishes and joined once, and a publish refused when one group would hold both kinds of receiver. SGLang
itself runs in tests/test_engine_sglang.py (gpu).
"""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.torch_group_member import LAYOUT
from trainer.broadcast.blocking import BlockingWeightBroadcaster
from trainer.broadcast.config import BroadcastConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def start_member(tmp_path):
    """Starts members (`start_member(*args)`: the address, and the folder it saves what it received into)."""
    procs = []

    def start(*args: str) -> tuple[str, pathlib.Path]:
        out = tmp_path / f"member{len(procs)}"
        out.mkdir()
        port_file = out / "port.json"
        proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "torch_group_member.py"), str(port_file),
                                 str(out), *args], env={**os.environ, "PYTHONPATH": str(ROOT)})
        procs.append(proc)
        deadline = time.monotonic() + 60
        while not port_file.exists():
            assert proc.poll() is None, "the member exited before serving"
            assert time.monotonic() < deadline, "the member did not start within 60 s"
            time.sleep(0.05)
        return f"127.0.0.1:{json.loads(port_file.read_text())['port']}", out

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(dtype) for name, (shape, dtype) in LAYOUT.items()}


def _check_received(out: pathlib.Path, version: int, sent: dict[str, torch.Tensor]) -> dict:
    saved = torch.load(out / f"v{version}.pt")
    received = saved["tensors"]
    assert received and received.keys() <= sent.keys()  # a tied model's lm_head travels once, as the embedding
    for name, tensor in received.items():
        assert tensor.dtype == sent[name].dtype and torch.equal(tensor, sent[name]), name
    return saved


def test_a_member_that_receives_itself_gets_every_tensor_by_broadcast(start_member):
    """Two publishes: each tensor arrives exactly, in its dtype and shape; the second reuses the group (the
    member joined one group only); buckets small enough that a bucket protocol would differ from per tensor."""
    address, out = start_member()
    broadcaster = BlockingWeightBroadcaster([address], BroadcastConfig(bucket_mb=0.001, timeout_s=30))
    try:
        for version in (1, 2):
            sent = _weights(seed=version)
            report = broadcaster.publish(sent, version)
            assert report.ok, report.failed
            assert report.group_reused == (version == 2)
            saved = _check_received(out, version, sent)
            assert saved["tensors"].keys() == sent.keys() and len(saved["joined"]) == 1
    finally:
        broadcaster.close()


def test_one_group_does_not_mix_receivers_of_both_kinds(start_member, tiny_model_dir, tmp_path, trainer_state):
    """A publish to a native rollout service and a member that receives itself fails for both, saying why; the
    member, never asked to receive, takes the next publish alone."""
    from deploy.local.service_process import start_service

    member, out = start_member(str(tiny_model_dir))
    rollout = start_service("rollout", {"model": str(tiny_model_dir)}, log_dir=tmp_path / "logs")
    broadcaster = BlockingWeightBroadcaster([rollout.address, member], BroadcastConfig(timeout_s=30))
    try:
        report = broadcaster.publish(trainer_state, 1)
        assert not report.ok and set(report.failed) == {rollout.address, member}
        assert all("one group cannot carry both" in why for why in report.failed.values())
        assert not (out / "v1.pt").exists()
        broadcaster.set_receivers([member])
        report = broadcaster.publish(trainer_state, 1)
        assert report.ok, report.failed
        _check_received(out, 1, trainer_state)
    finally:
        broadcaster.close()
        rollout.stop(timeout=10)


@pytest.fixture
def trainer_state(tiny_model_dir) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
