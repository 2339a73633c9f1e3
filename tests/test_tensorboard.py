"""A run's TensorBoard event files: one scalar namespace per member, read back as TensorBoard reads them."""

import json

import pytest
from buffer_samples import sample_proto
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from deploy.record.service_registry import REGISTRY_FILE
from deploy.record.status import run_targets
from deploy.record.tensorboard import RunBoard
from protos import buffer_pb2, buffer_pb2_grpc
from services.client import connect_sync

# Lines as trainer/loop.py report() and rollout/driver/producer.py snapshot() write them (a subset of their fields).
TRAINER_LINES = [
    {"step": 1, "weight_version": 1, "loss": 0.5, "reward_mean": 0.25, "staleness_mean": 0.5, "staleness_max": 1.0,
     "publish_s": 0.01},
    {"step": 2, "weight_version": 2, "loss": 0.4, "reward_mean": 0.375, "staleness_mean": 1.0, "staleness_max": 1.0,
     "publish_s": 0.02, "sample_ids": ["a", "b"], "lease_id": "L1"},
]
DRIVER_LINE = {"time": 1760000000.0, "elapsed_s": 4.0, "producer_id": "driver-1", "version": 2, "samples": 128,
               "tokens": 512, "completions_per_s": 32.0, "tokens_per_s": 128.0, "mean_reward": 0.3}


def append(path, records) -> None:
    with open(path, "a") as out:
        out.writelines(json.dumps(r) + "\n" for r in records)


def scalars(accumulator: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, pytest.approx(e.value)) for e in accumulator.Scalars(tag)]


def test_the_run_board_writes_every_namespace(tmp_path, service_factory):
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")}, registry=tmp_path / REGISTRY_FILE)
    with connect_sync(buffer.address) as channel:
        buffer_pb2_grpc.BufferStub(channel).Put(
            buffer_pb2.PutRequest(samples=[sample_proto(f"s{i}") for i in range(5)]), timeout=10)
    board = RunBoard(tmp_path, "driver", lambda: run_targets(tmp_path), service_interval_s=5.0)
    board.eval({"elapsed_s": 0.0, "accuracy": 0.25, "step": 0, "reward_mean": None})
    append(tmp_path / "trainer_metrics.jsonl", TRAINER_LINES[:1])
    board.tick(1.0)  # polls the services (the first tick)
    append(tmp_path / "trainer_metrics.jsonl", TRAINER_LINES[1:])
    append(tmp_path / "driver_stats.jsonl", [DRIVER_LINE])
    board.tick(3.0)  # JSONL only: the next poll is due at 6 s
    board.eval({"elapsed_s": 15.2, "accuracy": 0.5, "step": 2, "reward_mean": 0.31})
    board.close()

    logdir = tmp_path / "tensorboard"
    assert list(logdir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"trainer/loss", "trainer/reward_mean", "trainer/staleness_mean", "trainer/weight_version",
            "driver/tokens_per_s", "driver/completions_per_s", "eval/accuracy", "eval/reward_mean",
            "buffer/up", "buffer/weight_version", "buffer/queue_ready", "buffer/queue_leased"} <= tags
    assert not any(tag.endswith(("/step", "/time", "/producer_id", "/lease_id", "/sample_ids")) for tag in tags)
    assert scalars(events, "trainer/reward_mean") == [(1, 0.25), (2, 0.375)]
    assert scalars(events, "trainer/loss") == [(1, 0.5), (2, 0.4)]
    assert scalars(events, "driver/tokens_per_s") == [(3, 128.0)]
    assert scalars(events, "eval/accuracy") == [(0, 0.25), (15, 0.5)]
    assert scalars(events, "eval/reward_mean") == [(15, 0.31)]  # None is no point
    assert scalars(events, "buffer/queue_ready") == [(1, 5.0)]
    assert scalars(events, "buffer/up") == [(1, 1.0)]
    assert all(tag.split("/")[0] in {"trainer", "driver", "eval", "buffer"} for tag in tags)
