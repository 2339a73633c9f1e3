"""Reward functions for the scorer tests, imported by worker processes as tests.test_reward_plugins.

Kept apart from the tests (and light to import) because every fresh worker imports them.
"""

import os
import time

from protos.sample import Sample
from reward.sandbox import SandboxLimits, run_python


def length(sample: Sample, *, scale: float = 1.0) -> float:
    return scale * len(sample.response_text)


def hang(sample: Sample) -> float:
    time.sleep(3600)
    return 0.0


def crash(sample: Sample) -> float:
    os._exit(3)


def explode(sample: Sample) -> float:
    raise RuntimeError("boom")


def nap(sample: Sample, *, seconds: float) -> float:
    time.sleep(seconds)
    return 1.0


def batch_lengths(samples: list[Sample], *, offset: float = 0.0) -> list[float]:
    return [len(s.response_text) + offset for s in samples]


def one_result(samples: list[Sample]) -> list[float]:
    return [1.0]


def sleep_in_sandbox(sample: Sample, *, marker: str) -> float:
    """A sandboxed program that re-executes itself with `marker` on its command line, then sleeps."""
    program = ("import os, sys, time\n"
               f"if len(sys.argv) == 1:\n    os.execv(sys.executable, [sys.executable, '-I', 'main.py', {marker!r}])\n"
               "time.sleep(600)\n")
    run_python({"main.py": program}, "main.py", SandboxLimits(timeout_s=300, cpu_s=300))
    return 0.0


_PREPARED: set[str] = set()


def prepare_slowly(*, key: str) -> None:
    """A prepare hook that takes a while the first time in a process (like loading a model)."""
    if key not in _PREPARED:
        time.sleep(2.0)
        _PREPARED.add(key)


def needs_preparation(sample: Sample, *, key: str) -> float:
    if sample.response_text == "hang":
        time.sleep(3600)
    prepare_slowly(key=key)  # lazy: slow in a process that was never prepared
    return 1.0
