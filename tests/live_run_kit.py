"""Waiting on a run that a test started in a thread (deploy.runs.experiment_run.run_experiment): fail fast if it ends first."""

import threading
import time


def wait_for(condition, thread: threading.Thread, timeout: float, what: str) -> None:
    """Until `condition()` holds; an AssertionError if the run's `thread` ended first or `timeout` passed."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert thread.is_alive(), f"the run ended before {what}"
        assert time.monotonic() < deadline, f"not within {timeout:.0f}s: {what}"
        time.sleep(0.5)
