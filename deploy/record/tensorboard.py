"""TensorBoard event files of a run (runs/<name>/tensorboard/), beside its JSONL metrics and plot; the same scalars
go to Weights & Biases and MLflow when the run asks (deploy/record/loggers.py).

One scalar namespace per member of the run: trainer/... (each line of trainer_metrics.jsonl, at its
optimizer step), driver/... or runner/... (the producer's stats lines), eval/... (the held-out points of
metrics.jsonl), and buffer/..., rollout/..., reward/... (the services' own numbers, polled as `relayrl
status` reads them). Everything but the trainer is stepped by whole seconds of RL wall-clock.

    tensorboard --logdir runs/quickstart/tensorboard
"""

import pathlib
import time
from collections.abc import Callable

from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from deploy.record.progress import JsonlTail
from deploy.record.status import ServiceStatus, StatusPoller, Target

# Fields of the JSONL records that are not curves: the step itself, epoch seconds, ids.
_NOT_SCALARS = {"step", "time", "elapsed_s", "producer_id", "lease_id"}


def scalars(record: dict, prefix: str) -> dict[str, float]:
    """The numbers of one metrics record as tags `prefix/name` (one nested level: `prefix/name/key`)."""
    out: dict[str, float] = {}
    for name, value in record.items():
        if name in _NOT_SCALARS or isinstance(value, bool):
            continue
        if isinstance(value, int | float):
            out[f"{prefix}/{name}"] = float(value)
        elif isinstance(value, dict):
            out.update(scalars(value, f"{prefix}/{name}"))
    return out


def service_scalars(row: ServiceStatus) -> dict[str, float]:
    """One `relayrl status` row as tags under the service's name."""
    out = {f"{row.name}/up": float(row.up)}
    if row.weight_version is not None:
        out[f"{row.name}/weight_version"] = float(row.weight_version)
    out.update({f"{row.name}/queue_{k}": float(v) for k, v in row.queue.items()})
    out.update({f"{row.name}/{k}_per_s": v for k, v in row.throughput.items()})
    if row.staleness is not None:
        out[f"{row.name}/dropped_stale"] = float(row.staleness["dropped_stale"])
    if row.errors is not None:
        out[f"{row.name}/rpc_errors"] = float(row.errors["total"])
    return out


class ScalarWriter:
    """Scalars into one TensorBoard event file in `logdir`."""

    def __init__(self, logdir: pathlib.Path):
        logdir.mkdir(parents=True, exist_ok=True)
        self.events = EventFileWriter(str(logdir))

    def write(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        if not values:
            return
        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)
                                             for tag, value in values.items()])
        self.events.add_event(event_pb2.Event(wall_time=wall_time or time.time(), step=step, summary=summary))

    def close(self) -> None:
        self.events.close()


class RunBoard:
    """Mirrors a run's metrics into runs/<name>/tensorboard/ (and the other loggers of `writers`, deploy/record/loggers.py)
    as they appear.

    `tick(elapsed)` (the run's main loop calls it) copies the new JSONL lines of the trainer and the
    producer, and every `service_interval_s` polls the services in `targets`; `eval(point)` writes a
    held-out point where metrics.jsonl gets it.
    """

    def __init__(self, run_dir: pathlib.Path, producer: str, targets: Callable[[], list[Target]],
                 service_interval_s: float = 5.0, writers: list | None = None):
        self.writers = [ScalarWriter(run_dir / "tensorboard")] if writers is None else writers
        self.trainer = JsonlTail(run_dir / "trainer_metrics.jsonl")
        self.producer_name, self.producer = producer, JsonlTail(run_dir / f"{producer}_stats.jsonl")
        self.poller = StatusPoller(targets, timeout=2.0)
        self.service_interval_s, self.next_poll, self.elapsed = service_interval_s, 0.0, 0.0

    def write(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        if values:
            for writer in self.writers:
                writer.write(values, step, wall_time)

    def _copy_jsonl(self) -> None:
        for record in self.trainer.drain():
            self.write(scalars(record, "trainer"), int(record.get("step", 0)))
        for record in self.producer.drain():
            self.write(scalars(record, self.producer_name), int(self.elapsed), record.get("time"))

    def tick(self, elapsed: float) -> None:
        self.elapsed = elapsed
        self._copy_jsonl()
        if elapsed >= self.next_poll:
            self.next_poll = elapsed + self.service_interval_s
            for row in self.poller.refresh():
                self.write(service_scalars(row), int(elapsed))

    def eval(self, point: dict) -> None:
        self.write(scalars(point, "eval"), int(point["elapsed_s"]))

    def close(self) -> None:
        """Copy the last JSONL lines (what the trainer wrote as it stopped), then flush and close every writer."""
        self._copy_jsonl()
        for writer in self.writers:
            writer.close()
