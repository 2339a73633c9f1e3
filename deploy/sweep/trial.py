"""One trial of a sweep as a process: `relayrl run TRIAL.yaml` (an ordinary run) that the sweep watches and may stop.

    start `python -m deploy.sweep.trial PARENT_PID run TRIAL.yaml [--ray ADDRESS]`, which arms Linux's parent-death
        signal (SIGTERM when the sweep dies, even by SIGKILL: no trial outlives it) and becomes `relayrl run ...`
    -> each held-out evaluation the run appends to its metrics.jsonl handed to `on_point` as it appears
    -> `on_point` answers True (prune): SIGTERM, which `relayrl run` turns into a clean stop of every process it
       started (deploy/cli.py), as Ctrl-C does
"""

import ctypes
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from deploy.record.progress import JsonlTail

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 120.0  # a stopped run tears its services down in seconds; past this it is killed


class TrialProcess:
    """`relayrl run EXPERIMENT [--ray ADDRESS]` for one trial, its output to `log_path`."""

    def __init__(self, experiment: pathlib.Path, run_dir: pathlib.Path, log_path: pathlib.Path,
                 ray_address: str | None = None):
        self.run_dir, self.log_path = run_dir, log_path
        self.args = [sys.executable, "-m", "deploy.sweep.trial", str(os.getpid()), "run", str(experiment)]
        if ray_address is not None:
            self.args += ["--ray", ray_address]
        self.proc: subprocess.Popen | None = None
        self.pruned = False

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(pathlib.Path(__file__).resolve().parents[2]),
                                                                         os.environ.get("PYTHONPATH")]))}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env)

    def watch(self, on_point: Callable[[int, dict], bool], poll_s: float = 1.0) -> int:
        """Until the run ends: each new held-out point (its index from 0, the point) to `on_point`; True from it stops
        the run (pruned). The run's exit code."""
        curve, seen = JsonlTail(self.run_dir / "metrics.jsonl"), 0
        while True:
            code = self.proc.poll()
            for point in curve.drain():  # read after poll(): a run that ended has written all its points
                if not self.pruned and on_point(seen, point):
                    self.pruned = True
                    self.stop()
                seen += 1
            if code is not None:
                return self.proc.wait()
            time.sleep(poll_s)

    def stop(self) -> None:
        """SIGTERM (the run stops every process it started), SIGKILL after STOP_TIMEOUT_S."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main(argv: list[str]) -> int:
    """The trial process: armed to get SIGTERM when the sweep dies (the parent-death signal outlives exec), then
    `relayrl ARGS` in its place."""
    parent, args = int(argv[0]), argv[1:]
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the sweep died before the signal was armed
        return 128 + signal.SIGTERM
    os.execv(sys.executable, [sys.executable, "-m", "deploy", *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
