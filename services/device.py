"""One device layer: which device a process computes on, and the few things that differ by device type.

`torch.accelerator` (torch >= 2.6) names the machine's accelerator whatever its kind: CUDA, XPU, or Ascend NPU
once `torch_npu` is imported (it registers itself as an accelerator). Everything else asks here instead of
testing `torch.cuda` itself: the trainer's and the rollout engine's device (`device: auto`), the collective
backend that goes with it, the backend that moves weights and KV between processes (`backend: auto`), the
engine's default dtype, the current device of a thread, autocast, the fused optimizer, peak memory. A new kind of
accelerator is an entry in the tables below.
"""

import contextlib
import importlib.util

import torch
import torch.distributed as dist

# A device type's collective backend where torch.distributed's own map does not name it (torch_npu adds hccl).
_BACKENDS = {"npu": "hccl"}
DEVICE_TYPES = ("cpu", "cuda", "xpu", "npu")
# The transfer backend (services/weights/, rollout/pd/kv_group.py) that moves weights and KV between processes whose
# tensors are on a device type; any other type sends host bytes over gloo.
_TRANSFER_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}
# The rollout engine's compute dtype where `dtype` is left unset: float32 on the CPU (exact, and CPU bf16 matmuls are
# slower), bfloat16 on an accelerator (the fast kernels; float32 takes the slowest ones).
_ENGINE_DTYPES = {"cpu": "float32"}


def accelerator_type() -> str | None:
    """The accelerator's device type on this machine and torch build ("cuda", "xpu" or "npu"), None if none."""
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  registers the NPU with torch (the Ascend build)
    if hasattr(torch, "accelerator"):
        kind = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else None
    else:
        kind = "cuda" if torch.cuda.is_available() else None  # torch < 2.6
    return kind if kind in DEVICE_TYPES else None


def resolve_device(name: str = "auto", local_rank: int | None = None) -> torch.device:
    """The torch.device for a configured name: auto = the accelerator if there is one, else the CPU; a bare
    accelerator type takes `local_rank` as its index (torchrun's LOCAL_RANK), else the current device's."""
    kind = (accelerator_type() or "cpu") if name == "auto" else name
    if kind == "cpu":
        return torch.device("cpu")
    kind_type, _, index = kind.partition(":")
    module = getattr(torch, kind_type, None)  # torch.npu exists once torch_npu is imported
    if module is None or not module.is_available():
        raise ValueError(f"device {name!r}: torch has no usable {kind_type} device here")
    if index:
        return torch.device(kind_type, int(index))
    return torch.device(kind_type, local_rank if local_rank is not None else module.current_device())


def device_scope(device: torch.device) -> contextlib.AbstractContextManager:
    """`device` as the calling thread's current accelerator device while the block runs; nothing on the CPU.

    What a tensor's device does not name runs on the current device: a Triton launch, a CUDA graph's capture and
    replay, torch.cuda.synchronize(), a new stream. Each thread starts on device 0, so whatever drives an engine on
    `cuda:1` (its thread, its capture) enters this first."""
    if device.type in ("cpu", "meta"):
        return contextlib.nullcontext()
    return getattr(torch, device.type).device(device)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (no-op on CPU)."""
    if device.type not in ("cpu", "meta"):
        getattr(torch, device.type).synchronize(device)


def set_current(device: torch.device) -> None:
    """Make `device` this process's current accelerator device (no-op on CPU)."""
    if device.type != "cpu":
        getattr(torch, device.type).set_device(device.index or 0)


def collective_backend(device: torch.device | str) -> str:
    """torch.distributed's backend for tensors on `device` (or of a device type): nccl (cuda), xccl (xpu),
    hccl (npu), gloo (cpu)."""
    kind = device.type if isinstance(device, torch.device) else device
    return _BACKENDS.get(kind) or dist.Backend.default_device_backend_map.get(kind, "gloo")


def transfer_backend(device: torch.device | str) -> str:
    """The backend for weight updates and KV moved between processes whose tensors are on `device` (or a device
    type): nccl on CUDA, gloo elsewhere (host bytes)."""
    kind = device.type if isinstance(device, torch.device) else device.partition(":")[0]
    return _TRANSFER_BACKENDS.get(kind, "gloo")


def engine_dtype(device: torch.device | str) -> str:
    """The rollout engine's dtype when none is set: float32 on the CPU, bfloat16 on an accelerator."""
    kind = device.type if isinstance(device, torch.device) else device.partition(":")[0]
    return _ENGINE_DTYPES.get(kind, "bfloat16")


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """bf16 autocast on an accelerator when `dtype` is bfloat16; nothing on the CPU (float32 is exact there and
    CPU bf16 matmuls are slower), nor for float32."""
    if dtype == "bfloat16" and device.type != "cpu":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fused_optimizer(device: torch.device) -> bool:
    """Whether torch's fused optimizer kernels (AdamW fused=True) run on `device`."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    return device.type in _get_fused_kernels_supported_devices()


def reset_peak_memory(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).reset_peak_memory_stats(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Most bytes allocated by torch on `device` since the last reset; None on the CPU (no allocator counts)."""
    if device.type == "cpu":
        return None
    return getattr(torch, device.type).max_memory_allocated(device)


def peak_memory(device: torch.device) -> float:
    """Peak memory in bytes for a report: torch's peak allocation on an accelerator, the process's peak resident set
    on the CPU (where no allocator counts)."""
    allocated = peak_memory_bytes(device)
    if allocated is not None:
        return float(allocated)
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0  # Linux reports KiB
