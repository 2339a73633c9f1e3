"""The reward service's stage report (services/stage_reports.py): per interval, the time it was scoring (at least
one Score call in flight: decoding, scoring in the workers, the reply) and idle, which sum to the interval, and
`reward/*`: the calls and samples scored, and the calls' own seconds added up (above the scoring time when calls
overlap)."""

import threading
import time
from contextlib import contextmanager


class ScoringClock:
    def __init__(self) -> None:
        self._since = time.perf_counter()
        self._in_flight = 0
        self._lock = threading.Lock()  # report() runs on the writer's thread
        self._reset()

    def _reset(self) -> None:
        self.scoring_s = self.idle_s = self.call_s = 0.0
        self.calls = self.samples = 0

    def _charge(self, now: float) -> None:
        seconds, self._since = now - self._since, now
        if self._in_flight:
            self.scoring_s += seconds
        else:
            self.idle_s += seconds

    @contextmanager
    def call(self, samples: int):
        """Around one Score call of `samples` samples."""
        started = time.perf_counter()
        with self._lock:
            self._charge(started)
            self._in_flight += 1
        try:
            yield
        finally:
            now = time.perf_counter()
            with self._lock:
                self._charge(now)
                self._in_flight -= 1
                self.call_s += now - started
                self.calls += 1
                self.samples += samples

    def report(self) -> dict[str, float]:
        with self._lock:
            self._charge(time.perf_counter())
            report = {"stage/scoring_s": self.scoring_s, "stage/idle_s": self.idle_s,
                      "stage/interval_s": self.scoring_s + self.idle_s, "reward/calls": self.calls,
                      "reward/samples": self.samples, "reward/call_s": self.call_s}
            self._reset()
        return report
