"""`relayrl status`: the rows of deploy.record.status as one table (once, or refreshed live) or one JSON object."""

import json
import pathlib
import threading
import time
from collections.abc import Callable, Sequence

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from deploy.record.performance import performance, performance_table
from deploy.record.status import ServiceStatus, StatusPoller, Target, parse_address, run_targets
from services.config import ClientConfig

PERFORMANCE_WINDOW_S = 60.0  # the stage reports `relayrl status` sums: the last minute's
COLUMNS = ("service", "address", "health", "weight version", "queue", "staleness", "throughput /s", "errors")


def _pairs(values: dict, fmt: str = "{}") -> str:
    return ", ".join(f"{name} {fmt.format(value)}" for name, value in values.items()) or "-"


def _cells(row: ServiceStatus) -> tuple[str, ...]:
    health = row.health if row.up else f"[red]{row.health}[/]"
    if row.problem:
        health += f" ({row.problem})"
    staleness = "-"
    if row.staleness is not None:
        limit = row.staleness["max_staleness"]
        staleness = f"max {'none' if limit < 0 else limit}, {row.staleness['dropped_stale']} dropped stale"
    if row.errors is None:
        errors = "-" if row.metrics == "off" else f"metrics {row.metrics}"
    else:
        errors = str(row.errors["total"]) + (f" ({_pairs(row.errors['by_code'])})" if row.errors["total"] else "")
    return (f"{row.name} ({row.kind})" if row.kind != row.name else row.name, row.address, health,
            "-" if row.weight_version is None else str(row.weight_version), _pairs(row.queue), staleness,
            _pairs(row.throughput, "{:.1f}"), errors)


# A mixture-of-experts policy's figures the summary keeps (trainer/moe/metrics.py)
MOE_SUMMARY = ("moe/router_agreement", "moe/load_max_over_mean", "moe/aux_loss")


def trainer_summary(run_dir: pathlib.Path | None) -> dict | None:
    """The trainer's last step in a run folder (trainer_metrics.jsonl's last line): step, version, the
    rollout-vs-trainer logprob mismatch (trainer/mismatch.py) and a MoE policy's routing figures; None without one."""
    path = run_dir / "trainer_metrics.jsonl" if run_dir is not None else None
    if path is None or not path.exists() or path.stat().st_size == 0:
        return None
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 65536))
        lines = f.read().splitlines()
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by the seek, or still being written
        return {key: value for key, value in record.items()
                if key in ("step", "weight_version", *MOE_SUMMARY) or key.startswith("mismatch/")}
    return None


def runner_summary(run_dir: pathlib.Path | None) -> dict | None:
    """An agentic run's episode runners (runner_stats.jsonl, each runner's last line): episodes, episodes played again
    and groups dropped, each by cause (rollout/envs/runner.py); None without one."""
    path = run_dir / "runner_stats.jsonl" if run_dir is not None else None
    if path is None or not path.exists():
        return None
    last: dict[str, dict] = {}
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line still being written
        last[record.get("producer_id", "")] = record
    summary = {"episodes": 0, "replays_by_cause": {}, "drops_by_cause": {}}
    for record in last.values():
        summary["episodes"] += record.get("episodes", 0)
        for key in ("replays_by_cause", "drops_by_cause"):
            for cause, count in record.get(key, {}).items():
                summary[key][cause] = summary[key].get(cause, 0) + count
    return summary


def _runner_caption(runner: dict) -> str:
    text = f"episode runners: {runner['episodes']} episodes"
    for key, what in (("replays_by_cause", "played again"), ("drops_by_cause", "groups dropped")):
        text += f"; {what} {sum(runner[key].values())}" + (f" ({_pairs(runner[key])})" if runner[key] else "")
    return text


def _caption(trainer: dict | None, runner: dict | None = None) -> str | None:
    if runner is not None:
        return "\n".join(filter(None, [_caption(trainer), _runner_caption(runner)]))
    if trainer is None:
        return None
    text = f"trainer: step {trainer.get('step')}, weight version {trainer.get('weight_version')}"
    if "mismatch/abs_mean" in trainer:
        text += (f"; rollout-vs-trainer logprob mismatch mean {trainer['mismatch/abs_mean']:.3g}, max "
                 f"{trainer['mismatch/abs_max']:.3g}, k3 {trainer['mismatch/k3']:.3g}")
    if "moe/router_agreement" in trainer:
        text += f"; MoE router agreement {trainer['moe/router_agreement']:.3g}"
    if "moe/load_max_over_mean" in trainer:
        text += (f"; expert load max/mean {trainer['moe/load_max_over_mean']:.3g}, load-balancing loss "
                 f"{trainer['moe/aux_loss']:.3g}")
    return text


def table(rows: Sequence[ServiceStatus], title: str, trainer: dict | None = None, runner: dict | None = None) -> Table:
    view = Table(title=title, header_style="bold", caption=_caption(trainer, runner))
    for column in COLUMNS:
        view.add_column(column)
    for row in rows:
        view.add_row(*_cells(row))
    return view


def report(rows: Sequence[ServiceStatus], trainer: dict | None = None, runner: dict | None = None,
           perf: dict | None = None) -> dict:
    """The JSON object `relayrl status --json` prints (with a run folder, the trainer's last step too, an agentic
    run's episode runners, and where the time went: `performance`)."""
    out = {"time": time.time(), "services": [row.to_dict() for row in rows],
           "down": [row.name for row in rows if not row.up]}
    if trainer is not None:
        out["trainer"] = trainer
    if runner is not None:
        out["runner"] = runner
    if perf is not None:
        out["performance"] = perf
    return out


def targets_of(sources: Sequence[str]) -> tuple[Callable[[], list[Target]], str, pathlib.Path | None]:
    """A run folder (its services.json, read again on every refresh) or addresses; a title; the run folder."""
    if len(sources) == 1 and pathlib.Path(sources[0]).is_dir():
        run_dir = pathlib.Path(sources[0])
        return lambda: run_targets(run_dir), f"relayrl status: {run_dir}", run_dir
    fixed = [parse_address(text) for text in sources]
    return lambda: fixed, "relayrl status", None


class Display:
    """Where each refresh goes: a JSON line, a table updated in place (`live`, on a terminal), or the table
    printed again (a file or a pipe, where a live table would show nothing until the end)."""

    def __init__(self, console: Console, title: str, as_json: bool, live: bool, run_dir: pathlib.Path | None = None):
        self.console, self.title, self.as_json, self.live, self.run_dir = console, title, as_json, live, run_dir
        self.view: Live | None = None

    def show(self, rows: Sequence[ServiceStatus]) -> None:
        trainer, runner = trainer_summary(self.run_dir), runner_summary(self.run_dir)
        # where the time went over the last PERFORMANCE_WINDOW_S, from the stage reports (deploy/record/performance.py)
        perf = performance(self.run_dir, PERFORMANCE_WINDOW_S) if self.run_dir is not None else None
        if self.as_json:
            print(json.dumps(report(rows, trainer, runner, perf)), flush=True)
            return
        view = table(rows, self.title, trainer, runner)
        stages = performance_table(perf, f"where the time went, last {PERFORMANCE_WINDOW_S:.0f} s") if perf else None
        shown = view if stages is None else Group(view, stages)
        if not self.live:
            self.console.print(shown)
        elif self.view is None:
            self.view = Live(shown, console=self.console, refresh_per_second=4)
            self.view.start()
        else:
            self.view.update(shown)

    def close(self) -> None:
        if self.view is not None:
            self.view.stop()


def _waiting(work: Callable[[], list[ServiceStatus]]) -> list[ServiceStatus]:
    """work() on a daemon thread while this (main) thread waits in short slices: a poll blocked inside a synchronous
    gRPC call or an HTTP read does not see Ctrl-C until it returns, while the main thread's waits are interrupted at
    once. A poll still blocked when Ctrl-C lands is left to its thread, which dies with the process."""
    done: dict = {}

    def run() -> None:
        try:
            done["rows"] = work()
        except Exception as exc:  # noqa: BLE001  raised again in the main thread, as it was
            done["error"] = exc

    thread = threading.Thread(target=run, name="status-poll", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if "error" in done:
        raise done["error"]
    return done["rows"]


def status(sources: Sequence[str], *, watch: bool, as_json: bool, interval: float, timeout: float,
           client: ClientConfig | None = None, console: Console | None = None) -> int:
    """Poll, wait `interval`, poll again (rates need two polls), then print; with `watch`, keep refreshing
    every `interval` until interrupted (with `as_json`: one JSON object per line, per refresh).
    0 when every service is SERVING, 1 otherwise. Ctrl-C stops it at once, wherever it lands (a poll, the wait,
    the table being drawn): exit 0 with `watch` (how a watch ends), 130 without (the one answer was not given)."""
    # Without a terminal (a file, a pipe) nothing limits the width: rows stay one line each.
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 180)
    targets, title, run_dir = targets_of(sources)
    poller = StatusPoller(targets, client, timeout)
    display = Display(console, title, as_json, live=watch and console.is_terminal, run_dir=run_dir)
    rows: list[ServiceStatus] = []
    try:
        _waiting(poller.refresh)
        while True:
            time.sleep(interval)
            rows = _waiting(poller.refresh)
            display.show(rows)
            if not watch:
                break
    except KeyboardInterrupt:
        return 0 if watch else 130
    finally:
        display.close()
    return 0 if all(row.up for row in rows) else 1
