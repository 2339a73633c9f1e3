"""`relayrl profile RUN_DIR --steps N`: ask a live run's trainer for a torch.profiler capture of its next N steps.

The request is a file the trainer's ranks check once a step (trainer/profiling.py): RUN_DIR/profiles/request.json,
{"first": F, "last": L} in absolute steps (F: two steps past the last one trainer_metrics.jsonl records, so every
rank sees it before F begins). Then it waits for rank 0's trace and prints where it is.
"""

import json
import os
import pathlib
import sys
import time

from trainer.profiling import REQUEST

PROFILES = "profiles"


def last_step(run_dir: pathlib.Path) -> int:
    path = run_dir / "trainer_metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (json.JSONDecodeError, KeyError):
            continue  # a line the trainer is still writing
    return 0


def request_profile(run_dir: pathlib.Path, steps: int) -> tuple[int, int]:
    """Write the request (atomically); the steps it asks for."""
    folder = run_dir / PROFILES
    folder.mkdir(parents=True, exist_ok=True)
    first = last_step(run_dir) + 2
    request = {"first": first, "last": first + steps - 1}
    staging = folder / (REQUEST + ".tmp")
    staging.write_text(json.dumps(request))
    os.replace(staging, folder / REQUEST)
    return first, first + steps - 1


def main(run_dir: str, steps: int, timeout_s: float) -> int:
    folder = pathlib.Path(run_dir)
    if steps < 1:
        print("relayrl profile: --steps must be at least 1", file=sys.stderr)
        return 2
    if not (folder / "trainer.yaml").exists() and not (folder / "trainer_metrics.jsonl").exists():
        print(f"relayrl profile: {folder} is no run folder (no trainer.yaml, no trainer_metrics.jsonl)", file=sys.stderr)
        return 2
    asked = time.time()
    first, last = request_profile(folder, steps)
    print(f"asked the trainer for steps {first}-{last} ({folder / PROFILES / REQUEST})", flush=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done = [path for path in (folder / PROFILES).glob("trainer-rank0-steps*.json") if path.stat().st_mtime >= asked]
        if done:
            print(f"{done[0]}: open it in https://ui.perfetto.dev (each rank's trace beside it)")
            return 0
        time.sleep(0.2)
    print(f"relayrl profile: no trace within {timeout_s:.0f}s: is the run's trainer running (relayrl status {folder})?",
          file=sys.stderr)
    return 1
