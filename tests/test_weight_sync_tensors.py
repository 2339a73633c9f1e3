"""The trainer's publish to a receiver whose engine joins the group itself (SGLang's way), on CPU over gloo.

The receiver is a real WeightSync service in its own process (tests/torch_group_member.py): the project's
WeightReceiver over an engine side that makes only the torch.distributed calls SGLang's scheduler makes to join
(init_weights_update_group) and receive (update_weights_from_distributed). It checks our side of that contract:
the BeginUpdate reply that asks for tensor broadcasts, the trainer's group formed as torch.distributed forms a
named group, one broadcast per tensor in manifest order, each in its dtype and shape, the group kept across
publishes and joined once. SGLang itself runs in tests/test_engine_sglang.py (gpu).
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
from trainer.weight_broadcast import BlockingWeightBroadcaster, BroadcastConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def member(tmp_path):
    """The member's address and the folder it saves what it received into."""
    port_file = tmp_path / "port.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "torch_group_member.py"), str(port_file),
                             str(tmp_path)], env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not port_file.exists():
        assert proc.poll() is None, "the member exited before serving"
        assert time.monotonic() < deadline, "the member did not start within 60 s"
        time.sleep(0.05)
    yield f"127.0.0.1:{json.loads(port_file.read_text())['port']}", tmp_path
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator).to(dtype) for name, (shape, dtype) in LAYOUT.items()}


def test_a_member_that_receives_itself_gets_every_tensor_by_broadcast(member):
    """Two publishes: each tensor arrives exactly, in its dtype and shape; the second reuses the group (the
    member joined one group only); buckets small enough that a bucket protocol would differ from per tensor."""
    address, out = member
    broadcaster = BlockingWeightBroadcaster([address], BroadcastConfig(bucket_mb=0.001, timeout_s=30))
    try:
        for version in (1, 2):
            sent = _weights(seed=version)
            report = broadcaster.publish(sent, version)
            assert report.ok, report.failed
            assert report.group_reused == (version == 2)
            saved = torch.load(out / f"v{version}.pt")
            received = saved["tensors"]
            assert received.keys() == sent.keys()
            for name, tensor in sent.items():
                assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
            assert len(saved["joined"]) == 1
    finally:
        broadcaster.close()
