"""A service's stage reports: every `interval_s`, where its time went, written as one JSON line to
`stage_reports.dir/<service>-<pid>.jsonl` (RUN_DIR/stages in a run) and exported as Prometheus gauges.

The same form as the trainer's step reports (trainer/stages.py): `stage/<name>_s` for each stage (they sum to
`stage/interval_s`, no "other" bucket), `stage/report_time` (the interval's end, seconds since the epoch: two
consecutive ones bound an interval), and with a FLOP count `perf/flops`, `perf/flops_per_s`, `perf/peak_flops`,
`perf/mfu` over the device's peak (services/flops.py). The other keys are the service's own, under its name (the
engine's `engine/*`: tokens, queue waits, KV occupancy; the reward's `reward/*`: samples and calls). The service's `report()` is called on the writer's thread:
it returns the interval since its last call and starts the next.
"""

import json
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable

from prometheus_client import Gauge

from services.config import StageReportConfig

log = logging.getLogger(__name__)

STAGE_REPORT = Gauge("relayrl_stage_report", "The last stage report's values (stage/<name>_s: seconds of the "
                     "interval; perf/mfu; the service's tokens, waits and occupancy)", ["service", "key"])


def report_line(report: dict[str, float], peak_flops: float | None) -> dict[str, float]:
    """A service's interval (`stage/<name>_s`, `stage/interval_s`, perhaps `perf/flops`, its own keys) with the
    interval's end and, given a FLOP count and a peak, the utilisation."""
    line = {**report, "stage/report_time": time.time()}
    if "perf/flops" in report and peak_flops:
        interval = report["stage/interval_s"]
        per_s = report["perf/flops"] / interval if interval > 0 else 0.0
        line.update({"perf/flops_per_s": per_s, "perf/peak_flops": peak_flops, "perf/mfu": per_s / peak_flops})
    return line


class StageReportWriter:
    """Calls `report()` every `config.interval_s` on a thread of its own and writes each interval out."""

    def __init__(self, service: str, config: StageReportConfig, report: Callable[[], dict[str, float]],
                 peak_flops: Callable[[], float] | None = None) -> None:
        self.service, self.interval_s, self._report = service, config.interval_s, report
        self.path = pathlib.Path(config.dir) / f"{service}-{os.getpid()}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._peak_flops = peak_flops
        self._report()  # the first interval starts here, before serving: the start-up before it is no stage's
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"{service}-stage-reports", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        peak = self._peak_flops() if self._peak_flops is not None else None  # a probe, once, off the serving path
        while not self._stop.wait(self.interval_s):
            self.write(peak)
        self.write(peak)  # the last interval, up to the stop

    def write(self, peak: float | None) -> None:
        line = report_line(self._report(), peak)
        with open(self.path, "a") as out:
            out.write(json.dumps(line) + "\n")
        for key, value in line.items():
            STAGE_REPORT.labels(service=self.service, key=key).set(value)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)


def start_stage_reports(service: str, config: StageReportConfig, report: Callable[[], dict[str, float]] | None,
                        peak_flops: Callable[[], float] | None = None) -> StageReportWriter | None:
    """The writer, when the config names a folder and the service keeps a report; else None."""
    if config.dir is None or report is None:
        return None
    return StageReportWriter(service, config, report, peak_flops)
