"""services/teardown.py: a process that skips its final collection ends on its own last words, not on pages of
"nanobind: leaked" from triton's bindings (torch imports triton with torch._dynamo wherever it is installed); a signal
that arrives while a run stops its processes waits until they are all stopped."""

import signal
import subprocess
import sys

import pytest

from services.teardown import signals_deferred

SCRIPT = """
import sys
import triton  # noqa: F401  (what torch._dynamo does wherever triton is installed)
from services.teardown import skip_final_collection
try:
    print("the run's last word", file=sys.stderr)
finally:
    skip_final_collection()
"""


def test_a_process_with_triton_ends_on_its_own_last_words():
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    assert "nanobind" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().endswith("the run's last word")


def test_a_signal_within_the_block_is_handled_once_after_it():
    handled: list[str] = []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: handled.append("handler"))
    try:
        with signals_deferred(signal.SIGUSR1):
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)
            handled.append("teardown finished")
        assert handled == ["teardown finished", "handler"]
        signal.raise_signal(signal.SIGUSR1)  # the handler is back
        assert handled[-1] == "handler" and len(handled) == 3
    finally:
        signal.signal(signal.SIGUSR1, previous)
