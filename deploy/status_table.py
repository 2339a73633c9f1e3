"""`relayrl status`: the rows of deploy.status as one table (once, or refreshed live) or one JSON object."""

import json
import pathlib
import time
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.live import Live
from rich.table import Table

from deploy.status import ServiceStatus, StatusPoller, Target, parse_address, run_targets
from services.config import ClientConfig

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


def table(rows: Sequence[ServiceStatus], title: str) -> Table:
    view = Table(title=title, header_style="bold")
    for column in COLUMNS:
        view.add_column(column)
    for row in rows:
        view.add_row(*_cells(row))
    return view


def report(rows: Sequence[ServiceStatus]) -> dict:
    """The JSON object `relayrl status --json` prints."""
    return {"time": time.time(), "services": [row.to_dict() for row in rows],
            "down": [row.name for row in rows if not row.up]}


def targets_of(sources: Sequence[str]) -> tuple[Callable[[], list[Target]], str]:
    """A run folder (its services.json, read again on every refresh) or addresses; and a title."""
    if len(sources) == 1 and pathlib.Path(sources[0]).is_dir():
        run_dir = pathlib.Path(sources[0])
        return lambda: run_targets(run_dir), f"relayrl status: {run_dir}"
    fixed = [parse_address(text) for text in sources]
    return lambda: fixed, "relayrl status"


class Display:
    """Where each refresh goes: a JSON line, a table updated in place (`live`, on a terminal), or the table
    printed again (a file or a pipe, where a live table would show nothing until the end)."""

    def __init__(self, console: Console, title: str, as_json: bool, live: bool):
        self.console, self.title, self.as_json, self.live = console, title, as_json, live
        self.view: Live | None = None

    def show(self, rows: Sequence[ServiceStatus]) -> None:
        if self.as_json:
            print(json.dumps(report(rows)), flush=True)
        elif not self.live:
            self.console.print(table(rows, self.title))
        elif self.view is None:
            self.view = Live(table(rows, self.title), console=self.console, refresh_per_second=4)
            self.view.start()
        else:
            self.view.update(table(rows, self.title))

    def close(self) -> None:
        if self.view is not None:
            self.view.stop()


def status(sources: Sequence[str], *, watch: bool, as_json: bool, interval: float, timeout: float,
           client: ClientConfig | None = None, console: Console | None = None) -> int:
    """Poll, wait `interval`, poll again (rates need two polls), then print; with `watch`, keep refreshing
    every `interval` until interrupted (with `as_json`: one JSON object per line, per refresh).
    0 when every service is SERVING, 1 otherwise."""
    # Without a terminal (a file, a pipe) nothing limits the width: rows stay one line each.
    console = console or Console()
    if not console.is_terminal:
        console.width = max(console.width, 180)
    targets, title = targets_of(sources)
    poller = StatusPoller(targets, client, timeout)
    poller.refresh()
    time.sleep(interval)
    rows = poller.refresh()
    display = Display(console, title, as_json, live=watch and console.is_terminal)
    display.show(rows)
    if watch:
        try:
            while True:
                time.sleep(interval)
                rows = poller.refresh()
                display.show(rows)
        except KeyboardInterrupt:
            pass
        finally:
            display.close()
    return 0 if all(row.up for row in rows) else 1
