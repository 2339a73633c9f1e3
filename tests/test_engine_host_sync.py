"""No host sync inside an engine step (issues 28, 34): on a GPU, reading a device tensor from the host (`.tolist()`,
`.item()`, `.cpu()`, `nonzero()`, `bool(t)`) waits for every queued kernel, and so does a copy to the device from
pageable host memory (`torch.tensor(values, device=cuda)`). On CPU neither costs anything, so these tests make them
show: a guard that raises on each read, around the model's forward pass (the step's cache writes and reads,
attention); a recorder around the whole step (indices, sampling controls, static buffers, the kernel's plan) that
counts the host reads (one: the sampled tokens) and every tensor made from host values outside
rollout.kv.cache.to_device (pinned, non-blocking on CUDA: none); and the quantized cache on the meta device, where
any read of data raises. The GPU test counts syncs with CUDA's own sync debug mode."""

import contextlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.kv import cache as kv_cache
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


class _StepRecorder(TorchDispatchMode):
    """Counts the host reads (the Tensor methods of _READS, the ops of _OPS) while active."""

    def __init__(self, reads: list[str]):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func).rsplit(".", 1)[0] in _OPS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def record_host_traffic():
    """Yields (reads, pageable): the host reads made while active, and the tensors made from host values by any
    code but kv.cache.to_device (each a pageable copy when its device is a GPU), as 'file:line'."""
    reads, pageable = [], []
    saved = {name: getattr(torch.Tensor, name) for name in _READS}
    made = {name: getattr(torch, name) for name in ("tensor", "as_tensor")}

    def counted(name):
        def method(self, *args, **kwargs):
            reads.append(f"Tensor.{name}")
            return saved[name](self, *args, **kwargs)
        return method

    helper = getattr(getattr(kv_cache, "to_device", None), "__code__", None)

    def from_host(name):
        def factory(*args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code is not helper:
                pageable.append(f"{caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno}")
            return made[name](*args, **kwargs)
        return factory

    try:
        for name in _READS:
            setattr(torch.Tensor, name, counted(name))
        for name in made:
            setattr(torch, name, from_host(name))
        with _StepRecorder(reads):
            yield reads, pageable
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        for name, factory in made.items():
            setattr(torch, name, factory)


@pytest.mark.parametrize("kv_cache_dtype, cuda_graphs", [("auto", False), ("auto", True), ("int8", False)])
def test_a_whole_step_reads_back_once_and_copies_only_through_to_device(sharp_model_dir, kv_cache_dtype, cuda_graphs):
    """Every step of prefills, chunks mixed with decodes, decodes from the static buffers (cuda_graphs), forks that
    copy blocks (n = 2), sampled rows with top-k / top-p beside greedy ones: one host read per step that samples (the
    tokens and logprobs together, after the sampler), none in one that does not, and no tensor made from host values
    but by kv.cache.to_device (the old step made its row index, sampling controls and static inputs pageable)."""
    engine = LLMEngine(EngineConfig(model=str(sharp_model_dir), kv_cache_dtype=kv_cache_dtype, block_size=4,
                                    num_blocks=256, max_model_len=128, max_num_seqs=8, max_n=2,
                                    max_num_batched_tokens=16, cuda_graphs=cuda_graphs))
    step, steps = engine.step, []

    def recorded():
        with record_host_traffic() as (reads, pageable):
            outputs = step()
        steps.append((bool(outputs), list(reads), list(pageable)))
        return outputs

    engine.step = recorded
    prompts = [[3 + (i * 7 + j * 5) % 90 for j in range(n)] for i, n in enumerate([30, 5, 9])]
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=8, n=2, seed=1, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.7, max_tokens=10, seed=3, ignore_eos=True)]
    engine.generate(prompts, params)
    assert len(steps) > 10 and not all(sampled for sampled, _, _ in steps)  # a 30-token prompt takes two chunks
    assert {file for _, _, pageable in steps for file in pageable} == set()
    assert [reads for sampled, reads, _ in steps] == [["Tensor.tolist"] if sampled else [] for sampled, _, _ in steps]
    if cuda_graphs:
        assert engine.runner.graphs.num_replays > 0


def test_the_recorder_sees_pageable_copies_and_reads():
    with record_host_traffic() as (reads, pageable):
        ids = torch.tensor([1, 2, 3])
        kv_cache.to_device([4, 5], torch.int64, torch.device("cpu"))
        ids.tolist()
        (ids > 1).nonzero()
    assert pageable == [f"test_engine_host_sync.py:{sys._getframe().f_lineno - 4}"]
    assert reads[:2] == ["Tensor.tolist", "Tensor.nonzero"]


def test_to_device_pins_and_does_not_block_on_an_accelerator(monkeypatch):
    """On CUDA the host tensor is pinned and copied with non_blocking (the copy then queues behind the step's work
    instead of waiting for it); on the CPU it is the plain tensor."""
    made, moved = [], []
    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *args, **kwargs: (made.append(kwargs), tensor(*args))[1])
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: (moved.append((args, kwargs)), self)[1])
    kv_cache.to_device([1, 2], torch.int32, torch.device("cuda", 1))
    assert made == [{"dtype": torch.int32, "pin_memory": True}]
    assert moved == [((torch.device("cuda", 1),), {"non_blocking": True})]
    made.clear()
    kv_cache.to_device([1, 2], torch.int32, torch.device("cpu"))
    assert made == [{"dtype": torch.int32, "pin_memory": False}]


def test_the_kernels_plan_is_one_copy_through_to_device():
    """TritonAttention.plan (the Triton path's per-step tables) packs its tables into one to_device copy."""
    pytest.importorskip("triton")
    from rollout.model.attention_triton import TritonAttention

    with record_host_traffic() as (reads, pageable):
        plan = TritonAttention.plan([[3, 4], [7]], [1, 5], [6, 2], 4, 0.125, torch.device("cpu"))
    assert (reads, pageable) == ([], [])
    assert plan.block_tables.tolist() == [[3, 4], [7, 0]] and plan.query_starts.tolist() == [0, 1, 6]


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


@pytest.mark.gpu
@pytest.mark.parametrize("attention, cuda_graphs", [("triton", True), ("triton", False), ("torch", False)])
def test_on_cuda_a_whole_step_synchronizes_once(sharp_model_dir, attention, cuda_graphs):
    """CUDA's sync debug mode ("warn") around every whole step (prefill chunks, decodes, replays, sampling): one
    synchronizing call per step that samples (the tokens' read), none in one that does not."""
    import warnings

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = LLMEngine(EngineConfig(model=str(sharp_model_dir), device="cuda", block_size=4, num_blocks=256,
                                    max_model_len=128, max_num_seqs=8, max_n=2, max_num_batched_tokens=16,
                                    attention_backend=attention, cuda_graphs=cuda_graphs))
    step, steps = engine.step, []

    def counted():
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                outputs = step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs = [str(w.message)[:120] for w in caught if "synchroniz" in str(w.message)]
        steps.append((bool(outputs), syncs))
        return outputs

    prompts = [[3 + j % 90 for j in range(n)] for n in (30, 5, 9)]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, n=2, seed=2, ignore_eos=True)
    engine.generate(prompts, params)  # compiles the kernels and fills the allocators' caches
    engine.step = counted
    engine.generate([[4, *prompt] for prompt in prompts], params)
    assert len(steps) >= 12
    assert [len(syncs) for _, syncs in steps] == [int(sampled) for sampled, _ in steps], steps
