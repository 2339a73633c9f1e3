"""The device layer (services/device.py): one place decides the device, its collective backend, autocast and the
fused optimizer; the trainer (and its SFT warm-ups, through init_distributed) follows the configured device."""

import contextlib

import pytest
import torch

from services import device as devices
from trainer.parallel import init_distributed


def test_auto_is_the_cpu_without_an_accelerator(monkeypatch):
    monkeypatch.setattr(devices, "accelerator_type", lambda: None)
    assert devices.resolve_device("auto") == torch.device("cpu")
    assert devices.resolve_device("cpu", local_rank=3) == torch.device("cpu")


def test_auto_is_the_accelerator_with_its_index(monkeypatch):
    monkeypatch.setattr(devices, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert devices.resolve_device("auto") == torch.device("cuda", 2)
    assert devices.resolve_device("auto", local_rank=1) == torch.device("cuda", 1)  # torchrun's LOCAL_RANK
    assert devices.resolve_device("cuda:3") == torch.device("cuda", 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_asking_for_a_missing_accelerator_is_a_clear_error():
    with pytest.raises(ValueError, match="no usable cuda device"):
        devices.resolve_device("cuda")
    if not hasattr(torch, "npu"):
        with pytest.raises(ValueError, match="no usable npu device"):
            devices.resolve_device("npu")


def test_each_device_type_gets_its_collective_backend():
    # By type: torch.device("npu") exists only once torch_npu is imported.
    backends = {kind: devices.collective_backend(kind) for kind in devices.DEVICE_TYPES}
    assert devices.collective_backend(torch.device("cuda", 1)) == "nccl"
    assert backends == {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "npu": "hccl"}


def test_cpu_computes_in_float32_with_the_fused_optimizer():
    cpu = torch.device("cpu")
    assert isinstance(devices.autocast(cpu, "bfloat16"), contextlib.nullcontext)
    assert devices.fused_optimizer(cpu) and devices.fused_optimizer(torch.device("cuda"))
    assert devices.peak_memory_bytes(cpu) is None


def test_init_distributed_takes_the_configured_device(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed("cpu").device == torch.device("cpu")
    monkeypatch.setattr(devices, "accelerator_type", lambda: None)
    assert init_distributed("auto").device == torch.device("cpu")


@pytest.mark.gpu
def test_auto_is_the_gpu_on_a_gpu_machine():
    env = init_distributed("auto")
    assert env.device.type == "cuda" and env.device.index == torch.cuda.current_device()
    devices.reset_peak_memory(env.device)
    torch.ones(1024, device=env.device)
    assert devices.peak_memory_bytes(env.device) >= 4096
    assert isinstance(devices.autocast(env.device, "bfloat16"), torch.autocast)


def test_one_table_names_the_transfer_backend_and_engine_dtype_of_each_device_type():
    """Weight updates (trainer publish.backend: auto) and KV between workers (kv_group.backend: auto) take their
    backend from services.device.transfer_backend; a device type it does not list sends host bytes (gloo)."""
    from rollout.pd.kv_group import KVGroupConfig
    from trainer.config.publish import PublishConfig

    assert {kind: devices.transfer_backend(kind) for kind in devices.DEVICE_TYPES} == {
        "cpu": "gloo", "cuda": "nccl", "xpu": "gloo", "npu": "gloo"}
    assert devices.transfer_backend(torch.device("cuda", 1)) == "nccl"
    assert {kind: devices.engine_dtype(kind) for kind in devices.DEVICE_TYPES} == {
        "cpu": "float32", "cuda": "bfloat16", "xpu": "bfloat16", "npu": "bfloat16"}
    assert KVGroupConfig(master="h:1", world_size=2, rank=0, backend="auto").backend == "auto"
    assert PublishConfig(backend="auto").backend == "auto"


def test_the_trainers_publish_backend_auto_follows_its_device():
    """publish.backend: auto is the transfer backend of the trainer's device: gloo from the CPU, nccl from a GPU."""
    from trainer.config import TrainerConfig
    from trainer.run import RolloutPublisher

    config = TrainerConfig(model_path="m", device="cpu", publish={"receivers": ["127.0.0.1:1"], "backend": "auto"})
    for device, backend in ((torch.device("cpu"), "gloo"), (torch.device("cuda", 0), "nccl")):
        publisher = RolloutPublisher(config.publish, device)
        try:
            assert publisher._broadcaster.broadcaster.config.backend == backend
        finally:
            publisher._broadcaster.close()
