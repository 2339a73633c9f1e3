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
    if as_json:
        print(json.dumps(report(rows)), flush=True)
    if watch:
        live = None if as_json else Live(table(rows, title), console=console, refresh_per_second=4)
        try:
            if live is not None:
                live.start()
            while True:
                time.sleep(interval)
                rows = poller.refresh()
                if live is None:
                    print(json.dumps(report(rows)), flush=True)
                else:
                    live.update(table(rows, title))
        except KeyboardInterrupt:
            pass
        finally:
            if live is not None:
                live.stop()
    elif not as_json:
        console.print(table(rows, title))
    return 0 if all(row.up for row in rows) else 1
