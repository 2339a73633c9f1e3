"""What a run folder says about how the run went, read back for `relayrl doctor RUN_DIR` (deploy/inspect/diagnose.py).

    summary.json            present once the run finished (deploy/record/run_state.py)
    supervisor.jsonl        each death, restart and failure of a process (deploy/local/supervisor.py)
    trainer_metrics.jsonl   one record per optimizer step (trainer/loop.py)
    driver_stats.jsonl      the producer's running totals every 2 s (runner_stats.jsonl for an agentic job)
    metrics.jsonl           the held-out evaluations
    logs/*.log              every process's output, restarts appended
    config.yaml, trainer.yaml, services.json   what the run was told and where its services listened

Every record keeps its line number, so a finding can point at the evidence ("trainer_metrics.jsonl:12").
A file a killed process left half-written has its last line skipped.
"""

import json
import pathlib
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """One line of a file of the run: where it is (file relative to the run folder, 1-based number), what it says."""

    file: str
    number: int
    text: str

    def cite(self, width: int = 200) -> str:
        """`file:line: text`, a long line cut in its middle (an error's cause is often at its end)."""
        half = width // 2
        text = self.text if len(self.text) <= width else f"{self.text[:half - 3]} ... {self.text[-(half - 2):]}"
        return f"{self.file}:{self.number}: {text}"


@dataclass(frozen=True)
class Row:
    """One JSONL record and where it is."""

    file: str
    number: int
    record: dict

    def cite(self, *keys: str) -> str:
        shown = ", ".join(f"{key} {_number(self.record.get(key))}" for key in keys)
        return f"{self.file}:{self.number}: {shown}"


def log_lines(run_dir: pathlib.Path, name: str) -> list[Line]:
    """The lines of the run's log `name` ("logs/trainer.log"); [] when there is none."""
    path = pathlib.Path(run_dir) / name
    text = path.read_text(errors="replace") if path.exists() else ""
    return [Line(name, number, line) for number, line in enumerate(text.splitlines(), 1)]


def last_error(lines: list[Line]) -> Line | None:
    """The exception a log ends on: the last line of its last traceback (`module.SomeError: message`, whatever the
    exception's name), else the last line that names an error."""
    exception, in_traceback = None, False
    for line in lines:
        if line.text.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line.text.strip() and not line.text[0].isspace():
            exception, in_traceback = line, False
    if exception is not None:
        return exception
    for line in reversed(lines):
        text = line.text.strip()
        if text and (text.split(":")[0].endswith(("Error", "Exception", "Interrupt")) or " ERROR " in text):
            return line
    return None


def failure_reason(run_dir: pathlib.Path, what: str, log: str = "logs/trainer.log") -> str:
    """Why a run could not train: `what` happened, and the last error line of the process's `log` (the exception's
    last line, `file:line: text`) when it names one."""
    error = last_error(log_lines(run_dir, log))
    return f"{what}: {error.cite(width=600)}" if error is not None else f"{what} ({log} names no error)"


def _number(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


class RunRecord:
    """The files of one run folder, read once."""

    def __init__(self, run_dir: str | pathlib.Path):
        self.dir = pathlib.Path(run_dir)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"{self.dir} is not a folder")
        self.summary = self.read_json("summary.json")
        self.trainer = self.rows("trainer_metrics.jsonl")
        producer = "runner_stats.jsonl" if (self.dir / "runner_stats.jsonl").exists() else "driver_stats.jsonl"
        self.driver = self.rows(producer)
        self.curve = self.rows("metrics.jsonl")
        self.events = self.rows("supervisor.jsonl")
        self.config = self._yaml("config.yaml")
        self.trainer_config = self._yaml("trainer.yaml")
        self.services = self.read_json("services.json") or {}
        self._logs: dict[str, list[Line]] = {}

    @property
    def finished(self) -> bool:
        """The run ended and wrote its summary (trained or not: see `failure`)."""
        return self.summary is not None

    @property
    def failure(self) -> str | None:
        """Why the run could not train, as its summary says; a summary of no optimizer step written before runs said
        so counts too."""
        if self.summary is None:
            return None
        if self.summary.get("failure"):
            return self.summary["failure"]
        return "the trainer took no optimizer step" if self.summary.get("steps") == 0 else None

    def rows(self, name: str) -> list[Row]:
        path = self.dir / name
        if not path.exists():
            return []
        rows = []
        for number, text in enumerate(path.read_text(errors="replace").splitlines(), 1):
            try:
                record = json.loads(text)
            except json.JSONDecodeError:  # the last line of a process killed while writing it
                continue
            if isinstance(record, dict):
                rows.append(Row(name, number, record))
        return rows

    def log_names(self) -> list[str]:
        """The run's process logs, relative to the run folder (logs/trainer.log, ...)."""
        return sorted(str(p.relative_to(self.dir)) for p in (self.dir / "logs").glob("*.log"))

    def log(self, name: str) -> list[Line]:
        """The lines of a log ("logs/trainer.log"); [] when there is none."""
        if name not in self._logs:
            self._logs[name] = log_lines(self.dir, name)
        return self._logs[name]

    def grep(self, pattern: str, logs: list[str] | None = None, flags: int = 0) -> list[Line]:
        """Every line of the logs (default: all) that matches `pattern`."""
        compiled = re.compile(pattern, flags)
        return [line for name in (logs or self.log_names()) for line in self.log(name) if compiled.search(line.text)]

    def service_address(self, kind: str) -> list[str]:
        """Where the run's services of `kind` listened (services.json)."""
        entries = self.services.get("services", self.services) if isinstance(self.services, dict) else []
        if isinstance(entries, dict):
            entries = [{"name": name, **entry} for name, entry in entries.items() if isinstance(entry, dict)]
        return [e["address"] for e in entries if (e.get("kind") or e.get("name")) == kind and "address" in e]

    def read_json(self, name: str):
        path = self.dir / name
        try:
            return json.loads(path.read_text()) if path.exists() else None
        except (json.JSONDecodeError, PermissionError):
            return None

    def _yaml(self, name: str) -> dict:
        import yaml

        path = self.dir / name
        try:
            return (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
        except (yaml.YAMLError, PermissionError):
            return {}
