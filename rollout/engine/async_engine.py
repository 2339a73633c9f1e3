"""AsyncEngine: the LLMEngine driven by its own thread, used from asyncio: the `native` engine behind the
engine interface (rollout/engines/base.py).

The thread loops: run the commands queued by callers (add a request, abort, swap weights), then
one engine step, then hand each request's new tokens to its asyncio queue. Commands therefore run
between two steps, which is what makes a weight update atomic for in-flight sequences.
"""

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout.engine.errors import EngineDead
from rollout.engine.kv_handoff import add_prefilled_request, budget_batches, prefill_many_for_transfer
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.model_info import Layout, ModelInfo
from rollout.engine.outputs import Completion, TokenOutput
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.sequence import Sequence as EngineSequence
from rollout.engine.sessions import SessionRecord, SessionState
from rollout.kv.prefilled import PrefilledPrompt

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # items: list[TokenOutput] (list[Completion] when whole) or an exception that ended the engine
    whole: bool = False  # deliver nothing until every completion has finished, then all of them at once
    seqs: list[EngineSequence] = field(default_factory=list)  # the request's sequences, kept for a whole delivery


class AsyncEngine:
    """Drives a step engine from its own thread: the native LLMEngine, or an adapter with the same methods
    (rollout/engines/vllm_engine.py's VllmCore)."""

    def __init__(self, engine: LLMEngine, command_timeout_s: float = 300.0, idle_poll_s: float = 0.5):
        self.engine = engine
        self.info: ModelInfo = engine.info
        self.command_timeout_s = command_timeout_s  # longest a caller waits for a command (one step + itself)
        self._idle_poll_s = idle_poll_s
        self._commands: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # touched only by the engine thread
        self._transfer_prefills: list[tuple[str, list[int], SamplingParams, Future]] = []  # engine thread only
        self._stopping = threading.Event()
        self._error: BaseException | None = None
        self._version_changed: asyncio.Event | None = None  # made in the caller's loop at the first watch
        self._step_ended = 0.0  # perf_counter at the end of the last step (engine thread)
        self.last_pause_s = 0.0  # how long the last weight update kept the engine from stepping
        self._thread = threading.Thread(target=self._loop, name="rollout-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        """The model folder's tokenizer (loaded on first use)."""
        return self.engine.tokenizer

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    @property
    def stats(self) -> dict[str, int | float]:
        return self.engine.stats

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live, with the CUDA index (the step engine's)."""
        return self.engine.device

    def parameter_layout(self) -> Layout:
        """name -> (shape, dtype) of every parameter a weight update may carry."""
        return self.engine.parameter_layout()

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[Completion]:
        """Yield deltas of the request's n completions as the engine produces them.

        Raises InvalidRequest / QueueFull / DuplicateRequest on the first iteration when the engine
        refuses the request. Leaving the iteration early (a client gone) aborts the request, which
        frees its KV blocks.
        """
        prompt = list(prompt_ids)
        async for delta in self._stream(request_id, params.n,
                                        lambda: self.engine.add_request(request_id, prompt, params)):
            yield delta

    async def _stream(self, request_id: str, n: int, add: Callable[[], None]) -> AsyncIterator[Completion]:
        """Run `add` (queues request `request_id`) on the engine thread, then yield its n completions' deltas."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        unfinished = set(range(n))
        try:
            await self._call(lambda: self._add(request_id, add, stream))
            while unfinished:
                item = await stream.queue.get()
                items = [item]
                while not stream.queue.empty():
                    items.append(stream.queue.get_nowait())
                for delta in _merge(items):
                    if delta.finish_reason is not None:
                        unfinished.discard(delta.index)
                    yield delta
        finally:
            if unfinished:  # commands run in order, so this lands after the add, whatever became of it
                self._submit(lambda: self._abort_stream(request_id, stream))

    async def prefill_for_transfer(self, request_id: str, prompt_ids: Sequence[int],
                                   params: SamplingParams) -> PrefilledPrompt:
        """Prefill the prompt once between two steps, sample each completion's first token, and export the
        prompt's KV (rollout/engine/kv_handoff.py); raises like generate(). Calls that wait together run as one
        prefill batch (up to max_num_batched_tokens of prompt)."""
        prompt = list(prompt_ids)
        done: Future = Future()
        await self._call(lambda: self._transfer_prefills.append((request_id, prompt, params, done)))
        return await asyncio.wait_for(asyncio.wrap_future(done), self.command_timeout_s)

    def _run_transfer_prefills(self) -> None:
        """The queued prefill_for_transfer calls, in batches of at most max_num_batched_tokens prompt tokens."""
        pending, self._transfer_prefills = self._transfer_prefills, []
        for batch in budget_batches(pending, self.engine.config.max_num_batched_tokens):
            try:
                results = prefill_many_for_transfer(self.engine, [(rid, prompt, params) for rid, prompt, params, _ in batch])
            except Exception as exc:  # noqa: BLE001 - the batch's callers learn why; the loop goes on
                results = [exc] * len(batch)
            for (*_, done), result in zip(batch, results):
                if done.set_running_or_notify_cancel():
                    (done.set_exception if isinstance(result, Exception) else done.set_result)(result)

    async def generate_prefilled(self, request_id: str, prefilled: PrefilledPrompt,
                                 params: SamplingParams) -> AsyncIterator[Completion]:
        """Like generate(), for a request whose prompt KV and first tokens were computed elsewhere (the first
        delta carries the first tokens). Raises like generate(), and KVTransferInvalid, KVWeightVersionMismatch,
        QueueFull when the KV blocks are not free now (rollout/engine/kv_handoff.py)."""
        async for delta in self._stream(request_id, params.n,
                                        lambda: add_prefilled_request(self.engine, request_id, prefilled, params)):
            yield delta

    async def generate_all(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
        """The request's n completions, in index order, once all have finished (an abort keeps partial output).

        One hand-over per request instead of one per step, for callers that want only the result.
        Raises like generate(); cancelling the wait (a client gone) aborts the request.
        """
        prompt = list(prompt_ids)
        return await self._whole(request_id, lambda: self.engine.add_request(request_id, prompt, params))

    async def _whole(self, request_id: str, add: Callable[[], None]) -> list[Completion]:
        """Run `add` on the engine thread, then wait for the request's completions, all at once."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), whole=True)
        finished = False
        try:
            await self._call(lambda: self._add(request_id, add, stream))
            item = await stream.queue.get()
            if isinstance(item, BaseException):
                raise item
            finished = True
            return item
        finally:
            if not finished:
                self._submit(lambda: self._abort_stream(request_id, stream))

    async def compute_logprobs(
        self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], temperature: float = 1.0
    ) -> tuple[list[list[float]], int]:
        """Logprobs of each response's tokens given the prompt (under softmax(logits / temperature)), and the
        weight version used (between two steps)."""
        return await self._call(lambda: (self.engine.compute_logprobs(prompt_ids, responses, temperature),
                                         self.engine.weight_version))

    async def top_logprobs(
        self, prompt_ids: Sequence[int], response_ids: Sequence[int], temperature: float, top: int
    ) -> list[list[tuple[int, float]]]:
        """The `top` most likely tokens (id, logprob) at each position of a response (LLMEngine.compute_top_logprobs)."""
        return await self._call(lambda: self.engine.compute_top_logprobs(prompt_ids, response_ids, temperature, top))

    async def abort(self, request_id: str) -> bool:
        """Abort a request (or a session's running turn, by session id); its completions end with reason
        abort. Returns whether it was running."""
        return await self._call(lambda: self._abort(request_id) or self._abort(self.engine.session_turn(request_id)))

    # ---- sessions (rollout/engine/sessions.py); refusals raise the engine's errors (rollout/engine/errors.py)

    async def open_session(self, session_id: str, prompt_ids: Sequence[int]) -> int:
        """Open a session on its initial context; returns the context length."""
        prompt = list(prompt_ids)
        return await self._call(lambda: self.engine.open_session(session_id, prompt))

    async def append_to_session(self, session_id: str, token_ids: Sequence[int], turn_reward: float | None = None) -> int:
        """Append observation tokens (loss mask 0); returns the context length."""
        tokens = list(token_ids)
        return await self._call(lambda: self.engine.append_to_session(session_id, tokens, turn_reward))

    async def generate_in_session(self, session_id: str, params: SamplingParams, whole: bool = False
                                  ) -> AsyncIterator[Completion]:
        """Yield the deltas of the session's next turn (index 0), like generate(), or with `whole` the turn in one
        delta once it has finished (one hand-over instead of one per step); leaving early aborts the turn."""
        request_id = f"session/{session_id}/{uuid.uuid4().hex[:8]}"

        def add() -> None:
            self.engine.add_session_request(request_id, session_id, params)

        if whole:
            yield (await self._whole(request_id, add))[0]
            return
        async for delta in self._stream(request_id, 1, add):
            yield delta

    async def session_state(self, session_id: str) -> SessionState:
        return await self._call(lambda: self.engine.session_state(session_id))

    async def close_session(self, session_id: str) -> SessionRecord:
        """Close a session (aborting a running turn) and return its episode."""
        return await self._call(lambda: self._close_session(session_id))

    async def update_weights(self, weights: dict[str, torch.Tensor], version: int, adopt: bool = False) -> float:
        """Copy `weights` (name -> tensor) into the model between two steps, or with `adopt` serve them
        as they are (LLMEngine.load_weights); returns the seconds it took. `last_pause_s` says afterwards how
        long the engine ran no step for it: from the end of its last step (or the update's arrival, when that
        came later: it was idle) until the switch was done."""
        submitted = time.perf_counter()
        seconds = await self._call(lambda: self._switch_weights(weights, version, adopt, submitted))
        if self._version_changed is not None:  # wake the watchers; the next watch waits on a fresh event
            self._version_changed.set()
            self._version_changed = None
        return seconds

    async def watch_version(self, newer_than: int, wait_s: float) -> int:
        """The served weight version once it differs from `newer_than` (above: new weights; below: the caller
        knew an earlier process of this worker), or after `wait_s` the version then.

        Watchers and update_weights run in the same event loop (the server's)."""
        deadline = time.monotonic() + wait_s
        while self.weight_version == newer_than and (left := deadline - time.monotonic()) > 0:
            if self._version_changed is None:
                self._version_changed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._version_changed.wait(), left)
        return self.weight_version

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine thread; open streams end with EngineDead."""
        self._stopping.set()
        self._thread.join(timeout_s)

    # ---- engine thread ----

    def _loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._run_commands(block=not self.engine.has_unfinished_requests())
                if self._transfer_prefills:
                    self._run_transfer_prefills()
                self.engine.expire_sessions()
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                    self._step_ended = time.perf_counter()
        except BaseException as exc:  # the thread must not die silently: every waiter learns why
            log.exception("rollout engine thread crashed")
            self._error = exc
        finally:
            self._fail_everything(self._error or EngineDead("the rollout engine was shut down"))

    def _run_commands(self, block: bool) -> None:
        try:
            command, future = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
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

    def _add(self, request_id: str, add: Callable[[], list[TokenOutput] | None], stream: _Stream) -> None:
        outputs = add()  # tokens the request brings (a prefilled request's first tokens), or None
        self._streams[request_id] = stream
        if stream.whole:
            stream.seqs = self.engine.requests[request_id]
        if outputs:
            self._deliver(outputs)

    def _abort(self, request_id: str | None) -> bool:
        if request_id is None:
            return False
        outputs = self.engine.abort(request_id)
        self._deliver(outputs)
        return bool(outputs)

    def _abort_stream(self, request_id: str, stream: _Stream) -> None:
        """Abort the request only if `stream` still reads it (not a later request reusing the id)."""
        if self._streams.get(request_id) is stream:
            self._abort(request_id)

    def _close_session(self, session_id: str) -> SessionRecord:
        request_id = self.engine.session_turn(session_id)
        if request_id is not None:
            self._abort(request_id)  # its stream hears the abort
        return self.engine.close_session(session_id)

    def _switch_weights(self, weights: dict[str, torch.Tensor], version: int, adopt: bool, submitted: float) -> float:
        start = time.perf_counter()
        self.engine.load_weights(weights, version, adopt=adopt)
        done = time.perf_counter()
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
                      seq.kv_version)


def _put_all(deliveries: list[tuple[asyncio.Queue, list[TokenOutput]]]) -> None:
    for stream_queue, items in deliveries:
        stream_queue.put_nowait(items)


def _merge(items: list[list[TokenOutput] | BaseException]) -> list[Completion]:
    """Fold queued step outputs into one delta per completion, in completion order: a delta is a
    Completion holding only the tokens since the previous one."""
    deltas: dict[int, Completion] = {}
    for item in items:
        if isinstance(item, BaseException):
            raise item
        for output in item:
            deltas.setdefault(output.index, Completion(output.index)).add(output)
    return [deltas[index] for index in sorted(deltas)]
