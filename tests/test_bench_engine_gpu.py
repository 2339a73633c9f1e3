"""bench/engine_gpu.py's dry run on CPU (`--device cpu --quick`): the GPU bench's code paths (model, engine,
transformers, the floor) run end to end and print their result lines, so a GPU session does not find it broken."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_bench_runs_on_cpu_quick():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "bench/engine_gpu.py", "--device", "cpu", "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    results = [line for line in done.stdout.splitlines() if line.startswith("result: ")]
    assert len(results) == 4 and "native_step_vs_floor_bs16" in done.stdout, done.stdout
