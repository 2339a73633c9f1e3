"""The thread an engine steps on, and the commands callers queue to it: the half of AsyncEngine
(rollout/engine/async_engine.py) that runs off the asyncio loop.

The thread loops: run the commands queued by callers (add a request, abort, swap weights), then one engine
step, then hand each request's new tokens to its asyncio queue. Commands therefore run between two steps, which
is what makes a weight update atomic for in-flight sequences. The loop runs with the engine's device current
(services.device.device_scope): Triton launches and CUDA graph replays go to the current device, not their tensors'.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.engine.errors import EngineDead
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.model_info import ModelInfo
from rollout.engine.outputs import Completion, TokenOutput
from rollout.engine.sequence import Sequence as EngineSequence
from services.device import device_scope

log = logging.getLogger(__name__)


@dataclass
class Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # items: list[TokenOutput] (list[Completion] when whole) or an exception that ended the engine
    whole: bool = False  # deliver nothing until every completion has finished, then all of them at once
    seqs: list[EngineSequence] = field(default_factory=list)  # the request's sequences, kept for a whole delivery


class EngineThread:
    """A step engine (the native LLMEngine, or an adapter with its methods) on a thread of its own."""

    def __init__(self, engine: LLMEngine, command_timeout_s: float = 300.0, idle_poll_s: float = 0.5):
        self.engine = engine
        self.info: ModelInfo = engine.info
        self.command_timeout_s = command_timeout_s  # longest a caller waits for a command (one step + itself)
        self._idle_poll_s = idle_poll_s
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._streams: dict[str, Stream] = {}  # touched only by the engine thread
        self._transfer_prefills: list[tuple] = []  # (id, prompt, params, images, Future): engine thread only
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._version_changed: asyncio.Event | None = None  # made in the caller's loop at the first watch
        self._step_ended = 0.0  # perf_counter at the end of the last step (engine thread)
        self.last_pause_s = 0.0  # how long the last weight update kept the engine from stepping
        # the engine's stage report (rollout/engine/step_stats.py); None for an engine that keeps none
        self.step_stats = getattr(engine, "step_stats", None)
        self._switch = self.step_stats.switch if self.step_stats is not None else (lambda stage: None)
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; open streams end with EngineDead."""
        self._stopping.set()
        self._thread.join(timeout_s)

    # ---- engine thread ----

    def _loop(self) -> None:
        try:
            with device_scope(self.engine.device):  # a new thread's current device is cuda:0, whatever the engine's
                while not self._stopping.is_set():
                    self._run_commands(block=not self.engine.has_unfinished_requests())
                    if self._transfer_prefills:
                        self._run_transfer_prefills()
                    self.engine.expire_sessions()
                    if self.engine.has_unfinished_requests():
                        self._deliver(self.engine.step())  # its time: prefill and decode (LLMEngine.step)
                        self._step_ended = time.perf_counter()
        except BaseException as exc:  # the thread must not die silently: every waiter learns why
            log.exception("rollout engine thread crashed")
            self._error = exc
        finally:
            self._fail_everything(self._error or EngineDead("the rollout engine was shut down"))

    def _run_commands(self, block: bool) -> None:
        if block:
            self._switch("idle")
        try:
            command, future = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        finally:
            self._switch("commands")
        while True:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(command())
                except Exception as exc:  # noqa: BLE001 - a command's error belongs to its caller; the loop goes on
                    future.set_exception(exc)
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return

    def _add(self, request_id: str, add: Callable[[], list[TokenOutput] | None], stream: Stream) -> None:
        outputs = add()  # tokens the request brings (a prefilled request's first tokens), or None
        self._streams[request_id] = stream
        if stream.whole:
            stream.seqs = self.engine.requests[request_id]
        if outputs:
            self._deliver(outputs)

    def _add_all(self, adds: list[tuple[str, Callable[[], None]]], streams: list[Stream]) -> None:
        for index, ((request_id, add), stream) in enumerate(zip(adds, streams, strict=True)):
            try:
                self._add(request_id, add, stream)
            except Exception as exc:
                exc.request_index = index  # which of a GenerateMany's requests was refused
                raise

    def _abort(self, request_id: str | None) -> bool:
        if request_id is None:
            return False
        outputs = self.engine.abort(request_id)
        self._deliver(outputs)
        return bool(outputs)

    def _abort_stream(self, request_id: str, stream: Stream) -> None:
        """Abort the request only if `stream` still reads it (not a later request reusing the id)."""
        if self._streams.get(request_id) is stream:
            self._abort(request_id)

    def _switch_weights(self, weights: dict[str, torch.Tensor], version: int, adopt: bool, submitted: float) -> float:
        self._switch("weight_switch")
        start = time.perf_counter()
        self.engine.load_weights(weights, version, adopt=adopt)
        done = time.perf_counter()
        self._switch("commands")
        self.last_pause_s = done - max(submitted, self._step_ended)
        return done - start

    def _deliver(self, outputs: list[TokenOutput]) -> None:
        """Hand each request's outputs to its queue, waking each event loop once per step, not once per request."""
        by_request: dict[str, list[TokenOutput]] = {}
        for output in outputs:
            by_request.setdefault(output.request_id, []).append(output)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, list[TokenOutput]]]] = {}
        for request_id, items in by_request.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            done = request_id not in self.engine.requests
            if done:
                del self._streams[request_id]
            if stream.whole and done:
                items = [_completion(seq) for seq in stream.seqs]
            elif stream.whole:
                continue
            by_loop.setdefault(stream.loop, []).append((stream.queue, items))
        for loop, deliveries in by_loop.items():
            loop.call_soon_threadsafe(_put_all, deliveries)

    def _fail_everything(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
        self._streams.clear()
        pending, self._transfer_prefills = self._transfer_prefills, []
        for *_, future in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDead(f"the rollout engine stopped: {error!r}"))
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDead(f"the rollout engine stopped: {error!r}"))

    # ---- caller side ----

    def _submit(self, command: Callable[[], Any]) -> Future:
        future: Future = Future()
        if not self._thread.is_alive():
            future.set_exception(EngineDead(f"the rollout engine stopped: {self._error!r}"))
            return future
        self._commands.put((command, future))
        return future

    async def _call(self, command: Callable[[], Any]) -> Any:
        return await asyncio.wait_for(asyncio.wrap_future(self._submit(command)), self.command_timeout_s)


def _completion(seq: EngineSequence) -> Completion:
    return Completion(seq.index, seq.output_ids, list(seq.logprobs), list(seq.weight_versions), seq.finish_reason,
                      seq.kv_version, getattr(seq, "routed_experts", None), getattr(seq, "timing", None))


def _put_all(deliveries: list[tuple[asyncio.Queue, list[TokenOutput]]]) -> None:
    for stream_queue, items in deliveries:
        stream_queue.put_nowait(items)
