"""Supervision of a local run: a process that dies or freezes is started again, within bounds.

Each member (a service, the trainer, the driver) has a watcher thread. A member is down when its
process has exited (the trainer's exit 0 is its end, not a death) or is frozen (SIGKILLed first): a
service whose health check has gone unanswered for `health_timeout_s`, a client process whose heartbeat
file (the driver's stats, written every 2 s; the trainer's heartbeat_path, touched every 2 s by a
thread that beats through long steps and stops only with the whole process) has not been touched for
as long. A member that is down is started again after a backoff, services on their own address; one
that goes down more than `max_restarts` times within `restart_window_s` fails the run: `check()`
raises RunFailed naming it, with the tail of its log.

A member whose host is gone (MemberLost: a Ray node lost, deploy/cluster/ray_launcher.py) cannot be started again where
it was. One added with a `replace` callback (a rollout replica behind the router, deploy/local/replicas.py) is replaced by
whatever that callback starts elsewhere; any other fails the run at once, naming the member and the host lost.

With an events file (`record_events`: a run's supervisor.jsonl) each of these is a JSON line there (member, event:
down | restarted | failed, problem, pid), so a finished or failed run's folder tells what died and how often
(`relayrl doctor RUN_DIR`, deploy/inspect/diagnose.py).
"""

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.experiment.sections import SuperviseConfig
from deploy.local.service_process import LaunchError, ServiceProcess, tail_of
from services.client import connect_sync
from services.teardown import signals_deferred

log = logging.getLogger("relayrl.supervisor")
_ROOT = pathlib.Path(__file__).resolve().parents[2]


class RunFailed(RuntimeError):
    """A member went down more often than its restarts allow, or lost its host: the run cannot recover."""

    def __init__(self, name: str, problem: str, log_path: pathlib.Path, tail: str,
                 why: str = "its restarts are exhausted"):
        self.name, self.problem, self.why, self.log_path = name, problem, why, log_path
        super().__init__(f"{name} {problem}, and {why}: the run cannot recover.\n"
                         f"last lines of {log_path}:\n{tail}")


class MemberLost(RuntimeError):
    """Raised by a member's methods when the host it runs on is gone (`where`: which): it cannot be restarted there."""

    def __init__(self, name: str, where: str, cause: str):
        self.name, self.where, self.cause = name, where, cause
        super().__init__(f"{name} lost {where}: {cause}")


class Process:
    """A client process (trainer, driver) as a supervised member: `python ARGS`, logging to `log_path`."""

    def __init__(self, name: str, args: Sequence[str], log_path: pathlib.Path, exit_zero_is_done: bool = False,
                 heartbeat: pathlib.Path | None = None):
        self.name, self.args, self.log_path = name, list(args), log_path
        self.exit_zero_is_done, self.heartbeat = exit_zero_is_done, heartbeat
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0

    def silence(self) -> tuple[float, bool]:
        """(seconds since the heartbeat file or the start was last touched, whether it was touched since
        the start); (0, True) without a heartbeat."""
        if self.heartbeat is None:
            return 0.0, True
        touched = self.heartbeat.stat().st_mtime if self.heartbeat.exists() else 0.0
        return time.time() - max(touched, self.started_at), touched > self.started_at

    def start(self, timeout: float) -> None:
        self.started_at = time.time()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, *self.args], stdout=out, stderr=subprocess.STDOUT,
                                         env=env, cwd=_ROOT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (the trainer and driver finish cleanly), SIGKILL after `timeout` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 40) -> str:
        return tail_of(self.log_path, lines)


class Service:
    """A service process (deploy.local.service_process) as a supervised member, restarted on its own address."""

    def __init__(self, service: ServiceProcess):  # or one started elsewhere (deploy/cluster/ray_launcher.py)
        self.service, self.name, self.exit_zero_is_done = service, service.name, False

    @property
    def address(self) -> str:
        return self.service.address

    @property
    def client(self):
        """How its health is checked (services.config.ClientConfig; None = plain text)."""
        return self.service.client

    @property
    def pid(self) -> int:
        return self.service.pid

    @property
    def log_path(self) -> pathlib.Path:
        return self.service.log_path

    def start(self, timeout: float) -> None:
        self.service.restart(timeout)

    def exit_code(self) -> int | None:
        return self.service.exit_code()

    def kill(self) -> None:
        self.service.kill()

    def stop(self, timeout: float = 15.0) -> None:
        self.service.stop(timeout)

    def log_tail(self, lines: int = 40) -> str:
        return self.service.log_tail(lines)


@dataclass
class Record:
    """What happened to one member: its deaths (time, problem) and restarts."""

    deaths: list[tuple[float, str]] = field(default_factory=list)
    restarts: int = 0
    done: bool = False
    retired: bool = False  # stopped on purpose: no longer watched


def _healthy(address: str, timeout: float, client=None) -> bool:
    with connect_sync(address, client) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class Supervisor:
    """Watches members, restarts them when they go down, and fails the run when one cannot recover."""

    def __init__(self, config: SuperviseConfig | None = None):
        self.config = config or SuperviseConfig()
        self.members: dict[str, Process | Service] = {}
        self.records: dict[str, Record] = {}
        self.replacers: dict[str, Callable[[str], None]] = {}  # member name -> what replaces it when its host is lost
        self.failure: RunFailed | None = None
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # a restart and stop() never run at once
        self.events_path: pathlib.Path | None = None
        self._events_lock = threading.Lock()

    def record_events(self, path: pathlib.Path) -> None:
        """Append each death, restart and failure to `path` as a JSON line from now on."""
        self.events_path = path

    def _event(self, member: str, event: str, **fields) -> None:
        if self.events_path is None:
            return
        line = json.dumps({"time": round(time.time(), 3), "member": member, "event": event, **fields})
        with self._events_lock, open(self.events_path, "a") as out:
            out.write(line + "\n")

    def add_service(self, service: ServiceProcess,
                    replace: Callable[[str], None] | None = None) -> ServiceProcess:
        """Watch a started service (deploy.local.service_process.start_service). `replace(name)`, if given, is called when the
        service's host is lost (MemberLost) to start another in its place (and add it here); without it a lost
        host fails the run."""
        if replace is not None:
            self.replacers[service.name] = replace
        self._watch(Service(service))
        return service

    def add_process(self, name: str, args: Sequence[str], log_path: pathlib.Path,
                    exit_zero_is_done: bool = False, heartbeat: pathlib.Path | None = None) -> Process:
        """Start `python ARGS` and watch it; with `exit_zero_is_done` an exit 0 ends it for good; with a
        `heartbeat` file, one untouched for health_timeout_s means frozen."""
        return self.add(Process(name, args, log_path, exit_zero_is_done, heartbeat))

    def add(self, member: Process) -> Process:
        """Start a client process (a Process, or one started elsewhere: deploy/cluster/ray_launcher.py) and watch it."""
        member.start(self.config.start_timeout_s)
        self._watch(member)
        return member

    def _watch(self, member: Process | Service) -> None:
        with self._lock:  # one started while stop() runs (a replacement) is stopped here, not left running
            if self._stopping.is_set():
                member.stop()
                return
            self.members[member.name] = member
            self.records[member.name] = Record()
            thread = threading.Thread(target=self._run_watch, args=(member,), name=f"watch-{member.name}",
                                      daemon=True)
            self._threads.append(thread)
            thread.start()

    def done(self, name: str) -> bool:
        """Whether `name` ended for good (the trainer reached its step count)."""
        return self.records[name].done

    def check(self) -> None:
        """Raise RunFailed if a member could not be recovered."""
        if self.failure is not None:
            raise self.failure

    def restarts(self) -> dict[str, int]:
        return {name: record.restarts for name, record in self.records.items() if record.restarts}

    def stop_member(self, name: str, timeout: float | None = None) -> None:
        """Stop one member on purpose (SIGTERM; SIGKILL after `timeout` seconds, else its own default): it is not
        restarted."""
        with self._lock:
            self.records[name].retired = True
        member = self.members[name]
        if timeout is None:
            member.stop()
        else:
            member.stop(timeout)

    def stop(self) -> None:
        """Stop watching, then stop every member, the last added first (a SIGTERM meanwhile waits until all are
        stopped: raised in the middle, it left the members not yet stopped running)."""
        with signals_deferred(signal.SIGTERM):
            self._stopping.set()
            with self._lock:  # a restart under way finishes first; none starts after this
                pass
            for thread in self._threads:
                thread.join(10)
            for member in reversed(list(self.members.values())):
                try:
                    member.stop()
                except MemberLost as lost:  # the run already failed on it, or a replacement took its place
                    log.warning("%s", lost)

    # ------------------------------------------------------------------ one member's watcher

    def _run_watch(self, member: Process | Service) -> None:
        try:
            self._watch_until_over(member)
        except MemberLost as lost:
            self._lost(member, lost)

    def _watch_until_over(self, member: Process | Service) -> None:
        record = self.records[member.name]
        while not self._stopping.is_set() and not record.retired:
            problem = self._problem(member)
            if problem is None:
                self._stopping.wait(self.config.health_interval_s if isinstance(member, Service) else 0.25)
                continue
            if problem == "done":
                record.done = True
                return
            if record.retired:
                return
            if not self._recover(member, record, problem):
                return

    def _lost(self, member: Process | Service, lost: MemberLost) -> None:
        """Replace a member whose host is gone, if it has a replacer; else fail the run now (restarting it where it
        was is impossible, and the others hold its address)."""
        record = self.records[member.name]
        problem = f"lost {lost.where}" + (f" (its part {lost.name})" if lost.name != member.name else "")
        record.deaths.append((time.monotonic(), problem))
        log.error("%s", lost)
        self._event(member.name, "down", problem=problem)
        replace = self.replacers.get(member.name)
        with self._lock:
            if self._stopping.is_set() or record.retired:
                return
            record.retired = True
            if replace is None:
                self.failure = RunFailed(member.name, f"{problem}: {lost.cause}", member.log_path, tail_of(member.log_path),
                                         why="it cannot be started elsewhere (the others hold its address)")
                log.error("%s", self.failure)
                self._event(member.name, "failed", problem=problem, why="it cannot be started elsewhere")
                return
            del self.members[member.name]  # not stopped at the end: its host is gone
        try:  # not under the lock: the replacer adds its member here (_watch takes the lock)
            replace(member.name)
        except (RuntimeError, OSError, grpc.RpcError) as exc:  # no node left, a start or a router call failed
            self.failure = RunFailed(member.name, f"{problem}: {lost.cause}", member.log_path, tail_of(member.log_path),
                                     why=f"no replacement could be started ({str(exc).splitlines()[0]})")
            log.error("%s", self.failure)
            self._event(member.name, "failed", problem=problem, why="no replacement could be started")

    def _problem(self, member: Process | Service) -> str | None:
        code = member.exit_code()
        if code is not None:
            return "done" if code == 0 and member.exit_zero_is_done else f"exited with code {code}"
        if not isinstance(member, Service):
            silent, beating = member.silence()
            if silent > (self.config.health_timeout_s if beating else self.config.start_timeout_s):
                return f"left its heartbeat {member.heartbeat.name} untouched for {silent:.0f}s (frozen)"
            return None
        deadline = time.monotonic() + self.config.health_timeout_s
        while not _healthy(member.address, min(self.config.health_interval_s, 5.0), member.client):
            if self._stopping.is_set() or member.exit_code() is not None:
                return None  # a death is seen on the next round
            if time.monotonic() >= deadline:
                return f"answered no health check for {self.config.health_timeout_s:.0f}s (frozen)"
            self._stopping.wait(0.2)
        return None

    def _recover(self, member: Process | Service, record: Record, problem: str) -> bool:
        """Restart `member` (with backoff, retried while starts fail); False when restarts are exhausted."""
        cfg = self.config
        attempt = 0
        while not self._stopping.is_set():
            now = time.monotonic()
            record.deaths.append((now, problem))
            recent = [t for t, _ in record.deaths if now - t <= cfg.restart_window_s]
            log.warning("%s (pid %d) %s", member.name, member.pid, problem)
            self._event(member.name, "down", problem=problem, pid=member.pid)
            if len(recent) > cfg.max_restarts:
                self.failure = RunFailed(member.name, f"{problem} ({len(recent)} times in "
                                         f"{cfg.restart_window_s:.0f}s)", member.log_path, member.log_tail())
                log.error("%s", self.failure)
                self._event(member.name, "failed", problem=problem, why="its restarts are exhausted",
                            deaths=len(recent), window_s=cfg.restart_window_s, max_restarts=cfg.max_restarts)
                return False
            member.kill()
            if self._stopping.wait(min(cfg.backoff_s * 2**attempt, 30.0)):
                return False
            with self._lock:
                if self._stopping.is_set() or record.retired:
                    return False
                try:
                    member.start(cfg.start_timeout_s)
                except LaunchError as exc:
                    problem, attempt = f"failed to start again: {str(exc).splitlines()[0]}", attempt + 1
                    continue
            record.restarts += 1
            log.warning("%s restarted (pid %d, restart %d)", member.name, member.pid, record.restarts)
            self._event(member.name, "restarted", pid=member.pid, restarts=record.restarts)
            return True
        return False
