"""One sample's life is one trace across processes: rollout, reward and buffer as real service processes on loopback,
the driver and then the trainer played by the test process (each with its own tracer provider), all writing spans into
one folder; the trace context crosses gRPC metadata and, from the driver to the trainer, the durable buffer."""

import asyncio
import contextlib
import io
import itertools
import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from rich.console import Console

from deploy.experiment.tasks import arithmetic_tasks, write_jsonl
from deploy.record.performance import performance, performance_table
from deploy.record.progress import Progress
from deploy.record.run_state import Summary
from rollout.driver.driver import DriverConfig, drive
from services.config import TracingConfig
from services.tracing import setup_tracing, shutdown_tracing
from trainer.buffer_client import BufferClient
from trainer.config import TrainerConfig
from trainer.loop import train
from trainer.parallel import init_distributed
from trainer.run import RolloutPublisher

GROUP = 2
GROUPS = 2


def read_spans(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("spans-*.jsonl")) for line in path.read_text().splitlines()]


@contextlib.contextmanager
def traced(service: str, tracing: dict):
    """This test process plays `service` (the driver, then the trainer) with its own tracer provider."""
    assert setup_tracing(service, TracingConfig(**tracing))
    try:
        yield
    finally:
        shutdown_tracing()  # writes out what is queued


def test_one_samples_spans_cross_every_process_in_one_trace(tmp_path, service_factory, tiny_model_dir, monkeypatch):
    traces = tmp_path / "traces"
    tracing = {"dir": str(traces), "sample_rate": 1.0, "export_interval_s": 0.1}
    stages = {"dir": str(tmp_path / "stages"), "interval_s": 0.2}
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "server.tracing": tracing})
    rollout = service_factory("rollout", {"model": str(tiny_model_dir), "server.tracing": tracing,
                                          "server.stage_reports": stages})
    reward = service_factory("reward", {"server.tracing": tracing, "server.stage_reports": stages})
    prompts = write_jsonl(arithmetic_tasks(digits=1)[:GROUPS], tmp_path / "prompts.jsonl")
    with traced("driver", tracing):
        asyncio.run(drive(DriverConfig.model_validate({
            "rollout": rollout.address, "reward": reward.address, "buffer": buffer.address, "prompts": str(prompts),
            "tokenizer": str(tiny_model_dir), "group_size": GROUP, "max_groups": GROUPS, "merge_window_s": 0,
            "max_tokens": 4})))
    config = TrainerConfig.model_validate({
        "model_path": str(tiny_model_dir), "buffer": {"address": buffer.address, "max_wait_s": 30}, "max_steps": GROUPS,
        "batch": {"global_batch_size": GROUP, "micro_batch_size": GROUP},  # a step per group: a publish between
        "publish": {"receivers": [rollout.address], "timeout_s": 30},
        "metrics_path": str(tmp_path / "trainer_metrics.jsonl")})
    client = BufferClient(config.buffer)

    def no_profiler(*args, **kwargs):
        raise AssertionError("a profiler object was made with profile.steps unset")

    def no_nvtx(*args, **kwargs):
        raise AssertionError("an NVTX call was made with profiling off")

    monkeypatch.setattr(torch.profiler.profile, "__init__", no_profiler)  # (trainer/profiling.py: off is off)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", no_nvtx)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", no_nvtx)
    try:
        with traced("trainer", tracing):
            publisher = RolloutPublisher(config.publish)
            try:
                train(config, init_distributed("cpu"), client, publisher)
            finally:
                publisher.close()
    finally:
        client.close()
    for service in (buffer, rollout, reward):
        assert service.stop(timeout=20) == 0  # SIGTERM: each writes out its queued spans as it exits

    spans = read_spans(traces)
    by_id = {span["span_id"]: span for span in spans}
    by_trace = defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    roots = [span for span in spans if span["name"] == "driver.group"]
    assert len(roots) == GROUPS and all(root["parent_span_id"] is None for root in roots)
    for root in roots:
        trace = by_trace[root["trace_id"]]
        names = {(span["service"], span["name"]) for span in trace}
        assert {("rollout", "relayrl.rollout.v1.Rollout/GenerateMany"), ("reward", "relayrl.reward.v1.Reward/Score"),
                ("buffer", "relayrl.buffer.v1.Buffer/Put"), ("buffer", "buffer.lease"), ("buffer", "buffer.ack"),
                ("trainer", "trainer.step")} <= names, names
        # every non-root span's parent is a span of the same trace, and some parents live in another process
        crossing = set()
        for span in trace:
            if span is root:
                continue
            parent = by_id[span["parent_span_id"]]
            assert parent["trace_id"] == root["trace_id"]
            if parent["service"] != span["service"]:
                crossing.add((parent["service"], span["service"]))
        assert {("driver", "rollout"), ("driver", "reward"), ("driver", "buffer"), ("driver", "trainer")} <= crossing
        # inside the generate span: each completion's queue wait, prefill and decode in the engine, in order
        engine = sorted((span for span in trace if span["name"].startswith("engine.")), key=lambda s: s["start_ns"])
        assert {by_id[span["parent_span_id"]]["name"] for span in engine} == {"relayrl.rollout.v1.Rollout/GenerateMany"}
        for index in range(GROUP):
            mine = [span["name"] for span in engine if span["attributes"]["index"] == index]
            assert mine[:3] == ["engine.queue", "engine.prefill", "engine.decode"], mine
    # one weight version's publish is a trace too: the trainer's publish, each engine's BeginUpdate and CommitUpdate
    publishes = [span for span in spans if span["name"] == "trainer.publish"]
    assert publishes and all(span["parent_span_id"] is None for span in publishes)
    for publish in publishes:
        inside = {(span["service"], span["name"], by_id[span["parent_span_id"]]["service"])
                  for span in by_trace[publish["trace_id"]] if span is not publish}
        assert {("rollout", "relayrl.weights.v1.WeightSync/BeginUpdate", "trainer"),
                ("rollout", "relayrl.weights.v1.WeightSync/CommitUpdate", "trainer"),
                ("trainer", "engine.update", "trainer")} <= inside, inside
    # each train step's own span links the contexts of the samples it consumed: together, both groups' traces
    steps = [span for span in spans if span["name"] == "trainer.step" and span["parent_span_id"] is None]
    assert len(steps) == GROUPS and all(step["attributes"]["samples"] == GROUP for step in steps)
    assert {link["trace_id"] for step in steps for link in step["links"]} == {root["trace_id"] for root in roots}

    # the rollout's and the reward's stage reports (services/stage_reports.py): intervals tiled by their stages
    reports = {path.name.split("-")[0]: [json.loads(line) for line in path.read_text().splitlines()]
               for path in (tmp_path / "stages").glob("*.jsonl")}
    assert set(reports) == {"rollout", "reward"}
    for lines in reports.values():
        for line in lines:
            stage_sum = sum(value for key, value in line.items() if key.startswith("stage/") and key.endswith("_s")
                            and key != "stage/interval_s")
            assert stage_sum == pytest.approx(line["stage/interval_s"], rel=1e-6)
    rollout_lines = reports["rollout"]
    assert sum(line["engine/prefill_tokens"] for line in rollout_lines) > 0
    assert sum(line["engine/decode_tokens"] for line in rollout_lines) > 0
    assert any(0 < line["perf/mfu"] < 1 for line in rollout_lines)
    assert sum(line["reward/samples"] for line in reports["reward"]) == GROUP * GROUPS
    assert sum(line["stage/scoring_s"] for line in reports["reward"]) > 0

    # ... summed in NeMo-RL's form (deploy/record/performance.py), as `relayrl status` and the run's summary show it
    perf = performance(tmp_path)
    for part in perf.values():
        assert sum(stage["share"] for stage in part["stages"].values()) == pytest.approx(1.0)
    assert perf["rollout"]["tokens_per_s_per_device"] > 0 and 0 < perf["rollout"]["mfu"] < 1
    assert perf["reward"]["samples"] == GROUP * GROUPS
    assert perf["trainer"]["tokens_per_s_per_device"] > 0 and 0 < perf["trainer"]["mfu"] < 1
    (receiver,) = perf["trainer"]["refit"]  # the publish before step 2, as the rollout's CommitUpdate reply gave it
    assert receiver == rollout.address and set(perf["trainer"]["refit"][receiver]) == {"receive_s", "switch_s", "pause_s"}
    assert perf["trainer"]["peak_memory_gb"]["rank0"] > 0 and all(perf["rollout"]["peak_memory_gb"].values())
    console = Console(record=True, width=250)
    console.print(performance_table(perf))
    shown = console.export_text()
    assert all(word in shown for word in ("prefill", "decode", "scoring", "forward", "MFU", rollout.address)), shown
    # the run's summary at its finish: the same table, and summary.json's `performance`
    out = Console(file=io.StringIO(), width=250)
    Progress(tmp_path, out).finish(Summary(seed=0, sft_accuracy=None, final_accuracy=None, best_accuracy=None, steps=2,
                                           completions=GROUP * GROUPS, rl_seconds=1.0))
    assert "where the time went" in out.file.getvalue() and "decode" in out.file.getvalue()
    recorded = json.loads((tmp_path / "summary.json").read_text())["performance"]
    assert recorded["rollout"]["decode_tokens"] == perf["rollout"]["decode_tokens"]

    # `relayrl view`'s timeline of the last step across the services: its samples' lives, every process a lane
    from fastapi.testclient import TestClient

    from deploy.inspect.view import create_app

    reply = TestClient(create_app(tmp_path)).get("/api/timeline", params={"steps": 1})
    assert reply.status_code == 200
    last = reply.json()
    assert [step["last_step"] for step in last["steps"]] == [GROUPS]
    assert {lane["service"] for lane in last["lanes"]} == {"driver", "rollout", "reward", "buffer", "trainer"}
    consumed = {span["name"] for lane in last["lanes"] for span in lane["spans"] if span["consumed"]}
    assert {"driver.group", "engine.prefill", "engine.decode", "buffer.lease", "trainer.step"} <= consumed, consumed
    for lane in last["lanes"]:  # no two spans of a row overlap, and all lie in the window
        for row in range(lane["rows"]):
            placed = sorted((s["start_ms"], s["start_ms"] + s["dur_ms"]) for s in lane["spans"] if s["row"] == row)
            assert all(end <= start + 2e-3 for (_, end), (start, _) in itertools.pairwise(placed))  # ms to 3 places
        assert all(-1e-3 <= s["start_ms"] + s["dur_ms"] and s["start_ms"] <= last["window_ms"] + 1e-3
                   for s in lane["spans"])

    # `relayrl trace RUN_DIR`: the spans as a Chrome / Perfetto trace, read back
    from deploy.cli import main as relayrl

    assert relayrl(["trace", str(tmp_path), "--out", str(tmp_path / "trace.json"), "--seconds", "3600"]) == 0
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    complete = [event for event in events if event["ph"] == "X"]
    assert sorted(event["args"]["span_id"] for event in complete) == sorted(by_id)
    assert all(event["dur"] >= 0 and event["ts"] >= 0 for event in complete)
    named = {event["args"]["name"].split(" ")[0] for event in events if event["ph"] == "M"}
    assert named == {"driver", "rollout", "reward", "buffer", "trainer"}
    starts = {event["id"] for event in events if event["ph"] == "s"}
    assert starts and starts == {event["id"] for event in events if event["ph"] == "f"}  # arrows across processes
    # a window holds the spans overlapping it: the first 0 s of the run hold only what had begun by then
    assert relayrl(["trace", str(tmp_path), "--out", str(tmp_path / "first.json"), "--start", "0", "--seconds", "0"]) == 0
    first = [e for e in json.loads((tmp_path / "first.json").read_text())["traceEvents"] if e["ph"] == "X"]
    assert 0 < len(first) < len(complete) and all(event["ts"] <= 0 for event in first)

def test_tracing_off_installs_nothing_and_leaves_samples_untouched(tmp_path):
    from services.tracing import client_interceptors, current_traceparent, enabled, span

    assert not setup_tracing("test", TracingConfig())  # no dir, no endpoint: off
    assert not setup_tracing("test", TracingConfig(dir=str(tmp_path), sample_rate=0))
    assert not enabled() and client_interceptors() == []
    with span("driver.group") as current:
        assert current is None and current_traceparent() is None
    assert not list(tmp_path.iterdir())



def test_trace_of_a_run_without_spans_says_so(tmp_path, capsys):
    from deploy.cli import main as relayrl

    assert relayrl(["trace", str(tmp_path)]) == 2
    assert "no spans" in capsys.readouterr().err
