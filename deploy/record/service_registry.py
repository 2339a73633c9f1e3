"""services.json in a run folder: where each service of the run listens, rewritten when one restarts.

    {"buffer": {"address": "127.0.0.1:40123", "metrics_port": 40125, "pid": 812, "log": ".../buffer.log",
                "started_at": 1760000000.0, "kind": "buffer"}, ...}

A service's kind is what `relayrl serve KIND` ran; it differs from its name for rollout replicas behind a
router ("rollout-2", kind "rollout"). A replica removed by `relayrl deploy scale` is forgotten.

The launcher writes it (deploy.local.service_process.start_service with `registry=`); `relayrl status RUN_DIR` reads it.
"""

import json
import os
import pathlib
import threading
import time
from dataclasses import dataclass

REGISTRY_FILE = "services.json"

_lock = threading.Lock()  # the run's main thread and a supervisor's restart may record at once


@dataclass(frozen=True)
class ServiceEntry:
    """One service of a run as recorded: its name, gRPC address and /metrics port (None: none exported)."""

    name: str
    address: str
    metrics_port: int | None = None
    pid: int | None = None
    kind: str | None = None  # None: the name


def record(path: pathlib.Path, name: str, address: str, metrics_port: int | None, pid: int,
           log_path: pathlib.Path, kind: str | None = None) -> None:
    """Set `name`'s entry in the registry at `path` (written atomically: a reader never sees half a file)."""
    with _lock:
        entries = json.loads(path.read_text()) if path.exists() else {}
        entries[name] = {"address": address, "metrics_port": metrics_port, "pid": pid, "log": str(log_path),
                         "started_at": time.time(), "kind": kind or name}
        _write(path, entries)


def forget(path: pathlib.Path, name: str) -> None:
    """Remove `name`'s entry (a replica scaled away)."""
    with _lock:
        entries = json.loads(path.read_text()) if path.exists() else {}
        entries.pop(name, None)
        _write(path, entries)


def _write(path: pathlib.Path, entries: dict) -> None:
    tmp = path.with_suffix(path.suffix + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(entries, indent=2))
    os.replace(tmp, path)


def read(run_dir: pathlib.Path) -> list[ServiceEntry]:
    """The services recorded in `run_dir` (FileNotFoundError if it records none)."""
    entries = json.loads((run_dir / REGISTRY_FILE).read_text())
    return [ServiceEntry(name, e["address"], e.get("metrics_port"), e.get("pid"), e.get("kind"))
            for name, e in entries.items()]
