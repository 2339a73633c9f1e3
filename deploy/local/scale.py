"""`relayrl deploy scale rollout N --run RUN_DIR`: change how many rollout replicas a live local run has.

`scale(run_dir, "rollout", n)` is the API (the CLI and `relayrl status` call it): it asks the run's own process,
which supervises the replicas (deploy/local/replicas.py), through the run folder, and waits for its answer. A run started
without a router in front of its rollout cannot be scaled: the answer says to start it with replicas.
"""

import json
import pathlib
import sys
import time
import uuid

from deploy.local.replicas import request_path, result_path, write_json
from deploy.record import service_registry

SCALABLE = ("rollout",)


class ScaleError(RuntimeError):
    """The run cannot be scaled as asked (not live, no router, a failed start); the message says why."""


def replica_names(run_dir: pathlib.Path, service: str) -> list[str]:
    """The replicas of `service` the run records now (services.json: `rollout-1`, ... of kind rollout)."""
    return [e.name for e in service_registry.read(run_dir) if e.kind == service and e.name != service]


def scale(run_dir: pathlib.Path, service: str, replicas: int, timeout_s: float = 600.0) -> dict:
    """Ask the run in `run_dir` to run `replicas` replicas of `service`; its answer (the replicas after it, those
    added, those removed with whether each drained whole). Raises ScaleError."""
    if service not in SCALABLE:
        raise ScaleError(f"service: only {', '.join(SCALABLE)} scales, not {service!r}")
    if replicas < 1:
        raise ScaleError(f"replicas: at least 1, got {replicas}")
    try:
        names = replica_names(run_dir, service)
    except FileNotFoundError:
        raise ScaleError(f"{run_dir} records no services: is a run live there?") from None
    if not names:
        raise ScaleError(f"{run_dir}: its {service} has no replicas behind a router; start the run with "
                         "services.rollout.replicas (or rl.rollout_replicas) set to scale it")
    asked = {"id": uuid.uuid4().hex, "replicas": replicas}
    result = result_path(run_dir, service)
    write_json(request_path(run_dir, service), asked)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if result.exists():
            answer = json.loads(result.read_text())
            if answer["id"] == asked["id"]:
                if "error" in answer:
                    raise ScaleError(answer["error"])
                return answer
        time.sleep(0.2)
    raise ScaleError(f"the run in {run_dir} did not answer within {timeout_s:.0f}s (has it ended?)")


def main(service: str, replicas: int, run_dir: str, timeout_s: float) -> int:
    try:
        answer = scale(pathlib.Path(run_dir), service, replicas, timeout_s)
    except ScaleError as exc:
        print(f"relayrl deploy scale: {exc}", file=sys.stderr)
        return 2
    print(f"{service}: {len(answer['replicas'])} replicas ({', '.join(answer['replicas'])})")
    for name in answer["added"]:
        print(f"  added {name}")
    for name, how in answer["removed"].items():
        print(f"  removed {name}: " + ("drained" if how["drained"] else
                                       f"{how['in_flight']} requests, {how['sessions']} sessions left at the timeout"))
    return 0
