"""Runs broken on purpose, for `relayrl doctor RUN_DIR` (deploy/inspect/diagnose.py): each a real `relayrl run` of the user
project (tests/user_project.py) with one fault seeded, leaving its run folder as a failed or finished run does.

    killed_trainer   the trainer SIGKILLed each time it starts, until its restarts are exhausted (the run fails)
    zero_reward      a reward function registered by path that returns 0 for every completion
    publish_refused  the trainer publishes to a receiver that refuses connections (nothing listens on its port)

tests/data/runs/ holds trimmed copies of such runs (and of a healthy one), made by
    python tests/broken_runs.py OUT_DIR [FAULT ...] && python tests/broken_runs.py --trim OUT_DIR/FAULT/run DEST
`trim` keeps what `relayrl doctor RUN_DIR` reads, small: the JSONL files (the trainer's first 30 and last 10 steps),
each log's first and last lines and every line that warns, fails or starts a process, and no weights.
"""

import io
import os
import pathlib
import re
import signal
import socket
import sys
import threading
import time

from rich.console import Console

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from user_project import write_project

ZERO_REWARD = '''
def zero(sample):
    """Scores every completion 0: the seeded fault."""
    return 0.0
'''
FAULTS = ("killed_trainer", "zero_reward", "publish_refused")


def refusing_address() -> str:
    """A loopback address where nothing listens (connections are refused) at the moment of asking."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def settings(fault: str, folder: pathlib.Path) -> list[str]:
    """The --set overrides that seed `fault` into the project in `folder`."""
    if fault == "killed_trainer":
        return ["training.time_budget_s=150", "supervise.max_restarts=2", "supervise.backoff_s=0.2"]
    if fault == "zero_reward":
        (folder / "zero_reward.py").write_text(ZERO_REWARD)
        return ["training.time_budget_s=30", "reward.function=zero_reward:zero", "reward.args={}"]
    if fault == "publish_refused":
        return ["training.time_budget_s=30", "evaluation.every_s=10",
                f"services.trainer.settings={{publish.receivers: [{refusing_address()}]}}"]
    raise ValueError(f"no such fault: {fault}")


def kill_each_trainer(run_dir: pathlib.Path, stop: threading.Event, after_s: float = 2.0) -> None:
    """SIGKILL every trainer process the run starts, `after_s` after it logs its start (its pid)."""
    log, killed = run_dir / "logs" / "trainer.log", set()
    while not stop.wait(0.2):
        text = log.read_text(errors="replace") if log.exists() else ""
        for pid in map(int, re.findall(r"rank 0 of \d+ \(dp \d+ x tp \d+\) on \S+ \(pid (\d+)\)", text)):
            if pid not in killed:
                time.sleep(after_s)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended meanwhile
                    pass
                killed.add(pid)


def broken_run(fault: str, folder: pathlib.Path) -> pathlib.Path:
    """Run the user project in `folder` with `fault` seeded; its run folder (folder/run)."""
    from deploy.experiment.schema import load_experiment
    from deploy.local.supervisor import RunFailed
    from deploy.runs.experiment_run import run_experiment

    run_dir = folder / "run"
    project = write_project(folder, run_dir, lr=1e-3, max_steps=100000, time_budget_s=60)
    config = load_experiment(project, settings(fault, folder))
    stop = threading.Event()
    if fault == "killed_trainer":
        threading.Thread(target=kill_each_trainer, args=(run_dir, stop), daemon=True).start()
    try:
        run_experiment(config, console=Console(file=io.StringIO(), width=120))
    except RunFailed:
        assert fault == "killed_trainer", f"{fault}: the run failed"
    finally:
        stop.set()
    return run_dir


KEPT = ("summary.json", "supervisor.jsonl", "metrics.jsonl", "driver_stats.jsonl", "rl_clock.json", "services.json",
        "trainer.yaml")
NOTEWORTHY = re.compile(r"WARNING|ERROR|Error|Traceback|rank \d+ of|listening on|switched to|asked to stop|resumed")


def trim(run_dir: pathlib.Path, dest: pathlib.Path) -> None:
    """A small copy of a run folder for tests/data/runs/: what the doctor reads, absolute paths made RUN_DIR and
    PROJECT."""
    import shutil

    def clean(text: str) -> str:
        return text.replace(str(run_dir), "RUN_DIR").replace(str(run_dir.parent), "PROJECT")

    if dest.exists():
        shutil.rmtree(dest)
    (dest / "logs").mkdir(parents=True)
    for name in KEPT:
        if (run_dir / name).exists():
            (dest / name).write_text(clean((run_dir / name).read_text()))
    steps = (run_dir / "trainer_metrics.jsonl").read_text().splitlines(keepends=True)
    (dest / "trainer_metrics.jsonl").write_text("".join(steps if len(steps) <= 40 else steps[:30] + steps[-10:]))
    for log in sorted((run_dir / "logs").glob("*.log")):
        lines = log.read_text(errors="replace").splitlines(keepends=True)
        kept = [line for number, line in enumerate(lines) if number < 3 or number >= len(lines) - 3
                or NOTEWORTHY.search(line)]
        (dest / "logs" / log.name).write_text(clean("".join(kept[:40] + kept[-10:] if len(kept) > 50 else kept)))


if __name__ == "__main__":
    if sys.argv[1] == "--trim":
        trim(pathlib.Path(sys.argv[2]).resolve(), pathlib.Path(sys.argv[3]))
        sys.exit(0)
    out = pathlib.Path(sys.argv[1])
    for name in sys.argv[2:] or FAULTS:
        print(name, "->", broken_run(name, out / name), flush=True)
