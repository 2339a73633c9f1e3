"""A process that skips its final collection (services/teardown.py) ends on its own last words, not on pages of
"nanobind: leaked" from triton's bindings (torch imports triton with torch._dynamo wherever it is installed)."""

import subprocess
import sys

import pytest

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
