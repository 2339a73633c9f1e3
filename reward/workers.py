"""Worker processes that run reward functions, and a pool that kills and replaces a stuck one.

A reward function may hang (a sympy blow-up, a pathological regex, a custom function's bug);
a thread cannot be stopped, a process can. Each worker serves one call at a time over a socket pair;
a call that outlives its timeout gets the worker SIGKILLed and a fresh one started in its
place. Workers run functions in their main thread, so math-verify's SIGALRM timeouts work.
"""

import asyncio
import ctypes
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from protos.sample import Sample
from reward.registry import BadFunction, RewardOutput, RewardSpec, as_output, check_args, load

_PR_SET_PDEATHSIG = 1
_ROOT = pathlib.Path(__file__).resolve().parent.parent  # where the `reward` package lives


@dataclass
class Call:
    """One request to a worker: check a function's arguments, or score samples with it."""

    kind: str  # "check" | "score"
    spec: RewardSpec
    args: Mapping[str, Any]
    samples: list[Sample]


@dataclass
class Reply:
    """ok: outputs (one per sample; none for a check). Otherwise `message` says why."""

    kind: str  # "ok" | "bad_function" (request's fault) | "unavailable" (server's) | "error" (function raised)
    outputs: list[RewardOutput]
    message: str = ""


class WorkerDied(RuntimeError):
    """The worker exited (crash, OOM kill) before answering."""


def _serve_call(call: Call) -> Reply:
    try:
        fn = load(call.spec)
        check_args(call.spec, fn, call.args)
    except BadFunction as exc:
        return Reply("bad_function", [], str(exc))
    if call.kind == "check":
        return _prepare(call)
    return run_function(call.spec, fn, call.samples, call.args)


def run_function(spec: RewardSpec, fn: Callable, samples: list[Sample], args: Mapping[str, Any]) -> Reply:
    """Score `samples` with the loaded `fn` (in a worker, or inline in the server for safe built-ins)."""
    # A reward function's failure is the sample's result (FAILED with this reason), never the worker's end.
    try:
        if spec.batched:
            values = list(fn(samples, **args))
            if len(values) != len(samples):
                raise ValueError(f"{spec.name} returned {len(values)} results for {len(samples)} samples")
        else:
            values = [fn(sample, **args) for sample in samples]
        return Reply("ok", [as_output(value, spec.name) for value in values])
    except Exception as exc:  # noqa: BLE001
        return Reply("error", [], f"{type(exc).__name__}: {exc}"[:500])


def _prepare(call: Call) -> Reply:
    """Run the function's prepare hook (load a model) so that scoring does not pay for it."""
    if call.spec.prepare is None:
        return Reply("ok", [])
    # A hook that fails (a missing model folder) makes the function unavailable on this server.
    try:
        load(RewardSpec(call.spec.name, call.spec.prepare))(**call.args)
    except Exception as exc:  # noqa: BLE001
        return Reply("unavailable", [], f"function {call.spec.name!r} cannot be prepared: "
                                        f"{type(exc).__name__}: {exc}"[:500])
    return Reply("ok", [])


def worker_main(fd: int, threads: int) -> None:
    """A worker's loop: answer calls on the socket `fd` until the server closes it."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server decides when workers stop
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    conn = Connection(fd)
    while True:
        try:
            call = conn.recv()
        except EOFError:
            return
        conn.send(_serve_call(call))


class _Worker:
    """One worker process, started as `python -c ...` (no multiprocessing re-import of __main__)."""

    def __init__(self, threads: int):
        # The worker's temporary files (sandbox directories) live here, so that they go with it
        # when it is killed mid-call; traversable by the sandbox's unprivileged uid, not listable.
        self.tmpdir = tempfile.mkdtemp(prefix="relayrl-reward-worker-")
        os.chmod(self.tmpdir, 0o711)
        parent_sock, child_sock = socket.socketpair()
        code = f"from reward.workers import worker_main; worker_main({child_sock.fileno()}, {threads})"
        # Same working directory as the server (custom functions import as they would there),
        # and the relayrl source tree importable even when it is not installed.
        python_path = os.pathsep.join(p for p in (str(_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": python_path, "TMPDIR": self.tmpdir}
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child_sock.fileno()], env=env,
                                        stdin=subprocess.DEVNULL)
        child_sock.close()
        self.conn = Connection(parent_sock.detach())

    def alive(self) -> bool:
        return self.process.poll() is None

    async def request(self, call: Call, timeout: float) -> Reply:
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        fd = self.conn.fileno()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            self.conn.send(call)
            await asyncio.wait_for(readable, timeout)
            return self.conn.recv()
        except (EOFError, ConnectionError) as exc:
            raise WorkerDied(f"worker exited (code {self.process.poll()}): {exc}") from None
        finally:
            loop.remove_reader(fd)

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait(10)
        self.conn.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class WorkerPool:
    """`size` worker processes; at most `size` calls run at once, the rest wait their turn.

    A replacement worker first repeats the pool's latest check call (importing the function and
    preparing what it needs, e.g. loading a reward model) within `warmup_timeout_s`, so the next
    sample's timeout measures the function, not a cold start.
    """

    def __init__(self, size: int, name: str, threads_per_worker: int = 1, warmup_timeout_s: float = 120.0):
        if size <= 0:
            raise ValueError(f"{name}: pool size must be > 0, got {size}")
        self.size, self.name, self.threads, self.warmup_timeout_s = size, name, threads_per_worker, warmup_timeout_s
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._warmup: Call | None = None
        self._warming: set[asyncio.Task] = set()
        self.replaced = 0

    def _spawn(self) -> _Worker:
        worker = _Worker(self.threads)
        self._workers.add(worker)
        return worker

    def start(self) -> None:
        for _ in range(self.size):
            self._idle.put_nowait(self._spawn())

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers.discard(worker)
        self.replaced += 1
        fresh = self._spawn()
        if self._warmup is None:
            self._idle.put_nowait(fresh)
            return
        task = asyncio.get_running_loop().create_task(self._warm(fresh, self._warmup))
        self._warming.add(task)
        task.add_done_callback(self._warming.discard)

    async def _warm(self, worker: _Worker, call: Call) -> None:
        try:
            await worker.request(call, self.warmup_timeout_s)
        except (TimeoutError, WorkerDied):
            # No second warm-up: a function that cannot load shows up as its samples' failures.
            worker.kill()
            self._workers.discard(worker)
            worker = self._spawn()
        self._idle.put_nowait(worker)

    async def call(self, call: Call, timeout: float) -> Reply:
        """Run `call` on the next free worker; TimeoutError / WorkerDied when it hangs or dies."""
        if call.kind == "check":
            self._warmup = call
        worker = await self._idle.get()
        while not worker.alive():
            self._workers.discard(worker)
            worker.kill()
            worker = self._spawn()
        answered = False
        try:
            reply = await worker.request(call, timeout)
            answered = True
            return reply
        finally:
            # A worker that did not answer (timeout, death, cancelled call) may still be busy: replace it.
            if answered:
                self._idle.put_nowait(worker)
            else:
                self._replace(worker)

    def close(self) -> None:
        for task in self._warming:
            task.cancel()
        for worker in list(self._workers):
            worker.kill()
        self._workers.clear()
