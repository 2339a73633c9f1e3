"""Per-stage step reports (trainer/stages.py) and the FLOP count behind MFU (services/flops.py)."""

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from protos import buffer_pb2, buffer_pb2_grpc
from protos.sample import Sample
from services.client import connect_sync
from tests.test_trainer_step import config, local
from trainer.learner import Learner
from trainer.stages import STAGES

DELAY_S = 1.5
ROOT = Path(__file__).resolve().parents[1]


def long_samples(count: int, length: int, prefix: str = "s") -> list[Sample]:
    rng = np.random.default_rng(11)
    return [Sample(sample_id=f"{prefix}{i}", prompt_id=f"{prefix}p{i // 4}", group_size=4,
                   prompt_ids=np.array([1, 20 + i], dtype=np.int32),
                   response_ids=rng.integers(3, 90, length - i % 3).astype(np.int32),
                   loss_mask=np.ones(length - i % 3, dtype=np.uint8),
                   rollout_logprobs=np.full(length - i % 3, -4.6, dtype=np.float32),
                   weight_versions=np.zeros(length - i % 3, dtype=np.int64), reward=float(i % 2))
            for i in range(count)]


def test_the_step_flop_count_is_flop_counter_modes_within_10_percent(tiny_model_dir):
    learner = Learner(config(tiny_model_dir), local())
    # FlopCounterMode has no formula for the CPU's SDPA kernel; eager attention is the same math as matmuls it counts
    learner.policy.lm.set_attn_implementation("eager")
    # long rows: attention is ~20% of the FLOPs here, so a count without it would miss the bar
    (batch,) = learner.prepare(long_samples(8, 120))
    learner.stages.lap()
    with FlopCounterMode(display=False) as counter:
        learner.train_step(batch, 0)
    counted, measured = learner.stages.lap()["flops"], counter.get_total_flops()
    assert measured > 0 and abs(counted - measured) <= 0.1 * measured, (counted, measured)


def put(address: str, samples: list[Sample]) -> None:
    with connect_sync(address) as channel:
        buffer_pb2_grpc.BufferStub(channel).Put(buffer_pb2.PutRequest(samples=[s.to_proto() for s in samples]),
                                                timeout=30)


def test_each_steps_stages_sum_to_its_interval_and_show_where_it_waited(tiny_model_dir, tmp_path, service_factory):
    """A real loop against a buffer process, a batch held back, a checkpoint each step, and both steps captured by
    the profiler (profile.steps [1, 2]: their trace in profile.dir)."""
    from trainer.buffer_client import BufferClient
    from trainer.config import TrainerConfig
    from trainer.loop import train
    from trainer.parallel import init_distributed

    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    put(buffer.address, long_samples(8, 12, "a"))
    metrics = tmp_path / "metrics.jsonl"
    config = TrainerConfig.model_validate({
        "model_path": str(tiny_model_dir), "buffer": {"address": buffer.address, "max_wait_s": 30},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4}, "max_steps": 2, "metrics_path": str(metrics),
        "checkpoint": {"dir": str(tmp_path / "checkpoints"), "interval": 1},
        "profile": {"steps": [1, 2], "dir": str(tmp_path / "profiles")}})

    def second_batch_late() -> None:  # the trainer waits DELAY_S for its second batch
        while not metrics.exists():
            time.sleep(0.02)
        time.sleep(DELAY_S)
        put(buffer.address, long_samples(8, 12, "b"))

    feeder = threading.Thread(target=second_batch_late)
    feeder.start()
    client = BufferClient(config.buffer)
    started = time.monotonic()
    try:
        train(config, init_distributed("cpu"), client)
    finally:
        client.close()
        feeder.join()
    wall = time.monotonic() - started
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        parts = [step[f"stage/{name}_s"] for name in STAGES]
        assert all(part >= 0 for part in parts) and abs(sum(parts) - step["stage/step_s"]) < 1e-6
        assert min(step["stage/forward_s"], step["stage/backward_s"], step["stage/optimizer_s"]) > 0
        assert 0 < step["perf/mfu"] < 1 and step["perf/flops"] > 0
    # the intervals tile the loop: together they are the run less its start-up and its end (export, last checkpoint)
    assert sum(step["stage/step_s"] for step in steps) < wall
    second = steps[1]
    # the interval, measured apart: step 2's stages sum to the wall-clock time between the two reports, within 5%
    between = second["stage/report_time"] - steps[0]["stage/report_time"]
    assert abs(second["stage/step_s"] - between) <= 0.05 * between, (second["stage/step_s"], between)
    assert second["stage/data_wait_s"] >= 0.9 * DELAY_S  # waiting for the late batch
    assert second["stage/checkpoint_s"] > 0 and steps[0]["stage/checkpoint_s"] == 0  # step 1's checkpoint delays step 2
    assert max(STAGES, key=lambda name: second[f"stage/{name}_s"]) == "data_wait"
    (trace,) = (tmp_path / "profiles").iterdir()
    assert trace.name == "trainer-rank0-steps1-2.json"
    names = {event.get("name") for event in json.loads(trace.read_text())["traceEvents"]}
    assert "Optimizer.step#AdamW.step" in names and "aten::mm" in names, sorted(names)[:50]


@pytest.mark.ranks
def test_two_gloo_ranks_each_report_their_stages(tiny_model_dir, tmp_path, service_factory, free_port):
    """The trainer as the product runs it under torchrun: rank 1's stages reach rank 0's metrics line."""
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    put(buffer.address, long_samples(16, 12))
    metrics = tmp_path / "metrics.jsonl"
    settings = {"model_path": tiny_model_dir, "buffer.address": buffer.address, "buffer.max_wait_s": 60,
                "batch.global_batch_size": 8, "batch.micro_batch_size": 2, "max_steps": 2, "metrics_path": metrics}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port), "-m", "trainer"]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [step["step"] for step in steps] == [1, 2]
    for step in steps:
        for suffix in ("", "/rank1"):
            parts = [step[f"stage/{name}_s{suffix}"] for name in STAGES]
            assert abs(sum(parts) - step[f"stage/step_s{suffix}"]) < 1e-6
            assert step[f"stage/backward_s{suffix}"] > 0
    # after the first report's all-gather the ranks' intervals start and end together (their laps meet there)
    assert abs(steps[1]["stage/step_s"] - steps[1]["stage/step_s/rank1"]) < 0.2 * steps[1]["stage/step_s"] + 0.1


def test_relayrl_profile_captures_a_live_runs_next_steps(tiny_model_dir, tmp_path, service_factory):
    """`relayrl profile RUN_DIR --steps 2` while the trainer runs: the next two steps are captured."""
    from deploy.cli import main as relayrl
    from trainer.buffer_client import BufferClient
    from trainer.config import TrainerConfig
    from trainer.loop import train
    from trainer.parallel import init_distributed

    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    put(buffer.address, long_samples(8, 12, "a"))
    metrics = tmp_path / "trainer_metrics.jsonl"
    config = TrainerConfig.model_validate({
        "model_path": str(tiny_model_dir), "buffer": {"address": buffer.address, "max_wait_s": 30},
        "batch": {"global_batch_size": 8, "micro_batch_size": 4}, "max_steps": 4, "metrics_path": str(metrics),
        "profile": {"dir": str(tmp_path / "profiles")}})
    answers = []

    def ask_after_step_1() -> None:  # the trainer waits for batch 2 until the request is made
        while not metrics.exists():
            time.sleep(0.02)
        asking = threading.Thread(target=lambda: answers.append(relayrl(["profile", str(tmp_path), "--steps", "2",
                                                                          "--timeout", "120"])))
        asking.start()
        while not (tmp_path / "profiles" / "request.json").exists():
            time.sleep(0.02)
        put(buffer.address, long_samples(24, 12, "b"))
        asking.join()

    asker = threading.Thread(target=ask_after_step_1)
    asker.start()
    client = BufferClient(config.buffer)
    try:
        train(config, init_distributed("cpu"), client)
    finally:
        client.close()
        asker.join()
    assert answers[-1] == 0
    traces = sorted(path.name for path in (tmp_path / "profiles").glob("*.json") if path.name != "request.json")
    assert traces == ["trainer-rank0-steps3-4.json"]  # asked after step 1: steps 3 and 4
    names = {event.get("name") for event in json.loads((tmp_path / "profiles" / traces[0]).read_text())["traceEvents"]}
    assert "Optimizer.step#AdamW.step" in names


def test_nvtx_ranges_follow_the_stages_only_when_profiling(monkeypatch):
    """NVTX calls recorded on the CPU: with ranges on, each stage the clock enters is one range (the last one closed
    first); off (no profile.nvtx, no capture), or on a CPU device, the clock holds none and makes no call."""
    from trainer.config.profile import ProfileConfig
    from trainer.profiling import nvtx_ranges
    from trainer.stages import StageClock

    calls = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert nvtx_ranges(ProfileConfig(), cuda, capturing=False) is None
    assert nvtx_ranges(ProfileConfig(nvtx=True), cpu, capturing=True) is None
    for profile, capturing in ((ProfileConfig(nvtx=True), False), (ProfileConfig(), True)):
        calls.clear()
        clock = StageClock()  # times on the CPU; the ranges as on a CUDA device
        clock.ranges = nvtx_ranges(profile, cuda, capturing)
        clock.switch("forward")
        with clock.stage("backward"):
            pass
        clock.switch("optimizer")
        clock.ranges.close()
        assert calls == [("push", "stage/forward"), ("pop",), ("push", "stage/backward"), ("pop",),
                         ("push", "stage/forward"), ("pop",), ("push", "stage/optimizer"), ("pop",)]
    calls.clear()
    off = StageClock()
    off.switch("forward")
    off.lap()
    assert off.ranges is None and calls == []
