"""The native engine runs on its configured device whatever thread drives it (issue 34).

A Triton launch, a CUDA graph's capture and replay and torch.cuda.synchronize() act on the calling thread's current
device, which starts as cuda:0 on every thread: an engine on `cuda:1` must enter its device on the thread it steps on
and around its captures. The lent GPU machines have one GPU, so `cuda:1` is shown here on CPU: torch.cuda's device
context (and, for the capture, its streams and graphs) replaced by recorders, checking which device was current when
the work ran.
"""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine.engine_thread import EngineThread
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams

CUDA1 = torch.device("cuda", 1)


class Devices:
    """Stands for torch.cuda.device: a per-thread stack of current devices, and every entry as (thread, index)."""

    def __init__(self):
        self.local = threading.local()
        self.entered: list[tuple[str, int | None]] = []

    def current(self) -> int:
        stack = getattr(self.local, "stack", [])
        return stack[-1] if stack else 0  # a thread starts on device 0

    def __call__(self, device):
        devices = self

        class Scope:
            def __enter__(self):
                index = torch.device(device).index if not isinstance(device, int) else device
                devices.entered.append((threading.current_thread().name, index))
                devices.local.stack = [*getattr(devices.local, "stack", []), index]

            def __exit__(self, *exc):
                devices.local.stack.pop()

        return Scope()


@pytest.fixture
def devices(monkeypatch) -> Devices:
    recorder = Devices()
    monkeypatch.setattr(torch.cuda, "device", recorder)
    return recorder


class FakeStepEngine:
    """What EngineThread needs of a step engine, on `cuda:1`: each step records the device current when it ran."""

    def __init__(self, devices: Devices):
        self.info = SimpleNamespace()
        self.device = CUDA1
        self.devices = devices
        self.requests = {"r": None}
        self.stepped_on: list[int] = []

    def has_unfinished_requests(self) -> bool:
        return len(self.stepped_on) < 3

    def expire_sessions(self) -> None:
        pass

    def step(self) -> list:
        self.stepped_on.append(self.devices.current())
        return []


def test_the_engine_thread_steps_and_runs_commands_on_the_engines_device(devices):
    """Steps and commands (a weight switch, a request) run on the `rollout-engine` thread with cuda:1 current (the
    old thread never entered it: its steps ran on cuda:0)."""
    engine = FakeStepEngine(devices)
    thread = EngineThread(engine, idle_poll_s=0.01)
    try:
        deadline = time.monotonic() + 10
        while len(engine.stepped_on) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        command = thread._submit(devices.current).result(timeout=10)
    finally:
        thread.shutdown()
    assert engine.stepped_on == [1, 1, 1] and command == 1
    assert ("rollout-engine", 1) in devices.entered


class FakeCuda:
    """torch.cuda's streams, synchronize and graphs, recording which device was current at each."""

    def __init__(self, devices: Devices, monkeypatch):
        self.devices = devices
        self.events: list[tuple] = []
        self.on_side_stream = False
        fake = self

        class Stream:
            def __init__(self, device=None):
                fake.events.append(("stream", torch.device(device).index))

            def wait_stream(self, other):
                pass

        class StreamScope:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                fake.on_side_stream = True

            def __exit__(self, *exc):
                fake.on_side_stream = False

        class Graph:
            def pool(self):
                return "pool"

            def replay(self):
                fake.events.append(("replay", devices.current()))

        class Capture:
            def __init__(self, graph, pool=None, capture_error_mode="global"):
                self.mode = capture_error_mode

            def __enter__(self):
                fake.events.append(("capture", devices.current(), self.mode))

            def __exit__(self, *exc):
                pass

        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "stream", StreamScope)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.events.append(
            ("synchronize", devices.current() if device is None else torch.device(device).index)))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", Capture)


def test_every_capture_runs_on_the_engines_device_after_a_side_stream_warm_up(tiny_model_dir, devices, monkeypatch):
    """The static buffers of an engine made on CPU, set to capture as on cuda:1, captured from the main thread (whose
    current device is 0): each bucket's warm-up runs on a side stream and its capture with cuda:1 current, in
    capture_error_mode 'thread_local' (the old capture ran on device 0, warmed up on the current stream, in 'global')."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, max_model_len=64, max_num_seqs=4,
                                    max_n=2, cuda_graphs=True))
    graphs = engine.runner.graphs
    cuda = FakeCuda(devices, monkeypatch)
    warm_ups = []
    forward = graphs._forward
    monkeypatch.setattr(graphs, "_forward", lambda bucket: (warm_ups.append((bucket, cuda.on_side_stream)),
                                                            forward(bucket))[1])
    graphs.device, graphs.capture = CUDA1, True
    graphs.capture_all()
    assert sorted(graphs.graphs) == graphs.buckets == [1, 2, 4]
    captures = [event for event in cuda.events if event[0] == "capture"]
    assert captures == [("capture", 1, "thread_local")] * 3
    assert [on_side for _, on_side in warm_ups] == [True, False] * 3  # warm-up on the side stream, then the capture
    assert all(event[1] == 1 for event in cuda.events if event[0] in ("synchronize", "stream"))
    assert sorted(graphs.capture_stats) == [1, 2, 4]  # seconds and pool growth of each (bench/engine_gpu.py prints them)


def test_a_runner_step_and_a_weight_switch_enter_the_runners_device(tiny_model_dir, monkeypatch):
    """ModelRunner.run / score and LLMEngine.load_weights enter services.device.device_scope with the runner's
    device, so an engine driven from any thread (offline generate, the benches) runs where it was built."""
    from rollout.engine import llm_engine, model_runner

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, max_model_len=64, max_num_seqs=4,
                                    max_n=2))
    scopes = []
    real = model_runner.device_scope

    def recorded(device):
        scopes.append(device)
        return real(device)

    monkeypatch.setattr(model_runner, "device_scope", recorded)
    monkeypatch.setattr(llm_engine, "device_scope", recorded)
    engine.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=2))
    engine.compute_logprobs([3, 4], [[5, 6]])
    engine.load_weights(dict(engine.runner.model.named_parameters()), version=1)
    assert len(scopes) >= 4 and set(scopes) == {engine.runner.device}


def test_the_engine_takes_its_device_and_dtype_from_the_device_layer(tiny_model_dir, monkeypatch):
    """`engine.device: auto` as the trainer's `device: auto` (services/device.py): the accelerator when there is one,
    else the CPU; an unset dtype is float32 on the CPU and bfloat16 on an accelerator (an explicit one stays)."""
    from rollout.engines.settings import NativeSettings
    from services import device as devices

    assert (NativeSettings().device, NativeSettings().dtype) == ("auto", None)
    monkeypatch.setattr(devices, "accelerator_type", lambda: None)
    on_cpu = EngineConfig(model=str(tiny_model_dir), device="auto")
    assert (on_cpu.device, on_cpu.torch_dtype) == ("cpu", torch.float32)
    monkeypatch.setattr(devices, "accelerator_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    on_gpu = EngineConfig(model=str(tiny_model_dir), device="auto")
    assert (on_gpu.device, on_gpu.torch_dtype) == ("cuda:1", torch.bfloat16)
    assert EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32").torch_dtype == torch.float32
    assert EngineConfig(model=str(tiny_model_dir), device="cpu").torch_dtype == torch.float32

