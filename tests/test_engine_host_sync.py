"""No host sync inside an engine step (issue 28): on a GPU, reading a device tensor from the host (`.tolist()`,
`.item()`, `.cpu()`, `nonzero()`, `bool(t)`) waits for every queued kernel. On CPU such a read costs nothing, so
these tests make it fail: a guard that raises on each, around the model's forward pass (the step's cache writes and
reads, attention; the sampled tokens' one read comes after it); and the quantized cache on the meta device, where
any read of data raises. The GPU test counts syncs with CUDA's own sync debug mode."""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.kv.quantized import QuantizedKVCache, block_codec

torch.set_num_threads(1)
_READS = ("tolist", "item", "cpu", "numpy", "nonzero", "__bool__")
_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.masked_select", "aten.unique",
        "aten._unique2", "aten.repeat_interleave")  # each output's size (or value) is known only to the device


class HostRead(AssertionError):
    pass


class _RaiseOnHostReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).rsplit(".", 1)[0]
        masks = name in ("aten.index", "aten.index_put", "aten.index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if name in _OPS or masks:
            raise HostRead(f"{func} reads the device from the host inside a step")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads():
    """Any read of a tensor's data by the host raises HostRead while this is active."""
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name}() reads the device from the host inside a step")
        return method

    try:
        for name in _READS:
            setattr(torch.Tensor, name, refuse(name))
        with _RaiseOnHostReads():
            yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def guard_forward(engine: LLMEngine) -> list[int]:
    """Run every forward pass of `engine` under no_host_reads; returns a list that counts the passes."""
    model, passes = engine.runner.model, []
    forward = model.forward

    def guarded(*args, **kwargs):
        passes.append(1)
        with no_host_reads():
            return forward(*args, **kwargs)

    model.forward = guarded
    return passes


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
def test_a_step_reads_nothing_back_from_the_device(sharp_model_dir, kv_cache_dtype):
    """Prefill, decode over open and closed blocks, a pool that overflows, prefix caching and copy-on-write (n > 1):
    every forward pass runs without a host read (the quantized cache's write was planned from slot_mapping.tolist()
    and its read picked the open blocks by nonzero())."""
    engine = LLMEngine(EngineConfig(model=str(sharp_model_dir), kv_cache_dtype=kv_cache_dtype, block_size=4,
                                    num_blocks=256, max_model_len=128, max_num_seqs=8, max_n=4))
    passes = guard_forward(engine)
    prompts = [[3 + (i * 7 + j * 5) % 90 for j in range(n)] for i, n in enumerate([5, 16, 33, 9])]
    params = SamplingParams(temperature=1.0, max_tokens=10, n=2, seed=1, ignore_eos=True)
    first = engine.generate(prompts, params)
    again = engine.generate(prompts, params)  # the prompts' blocks from the prefix cache
    assert len(passes) >= 20 and engine.stats["prefix_cache_hit_tokens"] > 0
    assert [[c.token_ids for c in o.completions] for o in first] == [[c.token_ids for c in o.completions]
                                                                     for o in again]


def test_the_guard_catches_what_it_should():
    t = torch.arange(3)
    for read in (lambda: t.tolist(), lambda: t[0].item(), lambda: (t > 0).nonzero(), lambda: bool(t[1]),
                 lambda: int(t[1]), lambda: t[t > 0], lambda: t.cpu()):
        with no_host_reads(), pytest.raises(HostRead):
            read()
    assert t.tolist() == [0, 1, 2]


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_the_quantized_cache_runs_on_the_meta_device(kv_cache_dtype):
    """The meta device holds no data: a write planned from the host list, reads of open and closed blocks, block
    copies and a pool that grows all run there, so none of them reads the device."""
    layers, block, heads, dim = 2, 4, 2, 32
    cache = QuantizedKVCache(layers, 16, block, heads, dim, torch.bfloat16, torch.device("meta"),
                             block_codec(kv_cache_dtype, block), num_open_blocks=2)
    for slots in ([0, 1, 2, 3, 4, 5], [6], [8, 12, 16], list(range(20, 32)) + [40]):  # whole, open, closing, extra
        slot_mapping = torch.tensor(slots, device="meta")
        cache.plan_write(slots, slot_mapping)
        for layer in range(layers):
            kv = torch.empty(len(slots), heads, dim, dtype=torch.bfloat16, device="meta")
            cache.write(layer, slot_mapping, kv, kv)
        for layer in range(layers):
            keys, _ = cache.read_blocks(layer, torch.tensor([0, 1, 2, 5, 10], device="meta"))
            assert keys.shape == (5, block, heads, dim) and keys.dtype == torch.bfloat16 and keys.device.type == "meta"
    cache.copy_blocks([1, 2], [13, 14])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype, attention", [("auto", "torch"), ("int8", "torch"), ("int8", "triton")])
def test_on_cuda_a_step_forward_does_not_synchronize(sharp_model_dir, kv_cache_dtype, attention):
    """CUDA's sync debug mode raises on any synchronizing call inside the forward passes (prefill and decode; eager:
    CUDA graphs are off for the torch path and for a quantized cache)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = LLMEngine(EngineConfig(model=str(sharp_model_dir), kv_cache_dtype=kv_cache_dtype, device="cuda",
                                    block_size=4, num_blocks=256, max_model_len=128, max_num_seqs=8,
                                    attention_backend=attention))
    model, forward, passes = engine.runner.model, engine.runner.model.forward, []

    def strict(*args, **kwargs):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            passes.append(1)
            return forward(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    model.forward = strict
    engine.generate([[3, 4, 5, 6, 7, 8, 9]] * 3, SamplingParams(temperature=1.0, max_tokens=12, seed=2,
                                                                ignore_eos=True))
    assert len(passes) >= 12
