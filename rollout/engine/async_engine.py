"""AsyncEngine: the LLMEngine driven by its own thread (rollout/engine/engine_thread.py), used from asyncio: the
`native` engine behind the engine interface (rollout/engines/base.py).

Each call here queues a command that the engine thread runs between two steps (so a weight update is atomic for
in-flight sequences) and awaits its result or its stream of tokens. The prefill worker's batched prefills for
transfer (rollout/pd/) run on the thread too, between commands and the next step.
"""

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future

import torch

from rollout.engine.engine_thread import EngineThread, Stream
from rollout.engine.errors import NotAdmitted
from rollout.engine.kv_handoff import add_prefilled_request, budget_batches, prefill_many_for_transfer
from rollout.engine.model_info import Layout
from rollout.engine.multimodal import ImageInput
from rollout.engine.outputs import Completion, TokenOutput
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.sessions import SessionRecord, SessionState
from rollout.kv.prefilled import PrefilledPrompt

log = logging.getLogger(__name__)

_ADMISSION_POLL_S = 0.02  # how often a session queued for admission asks again


class AsyncEngine(EngineThread):
    """Drives a step engine from its own thread: the native LLMEngine, or an adapter with the same methods
    (rollout/engines/vllm_engine.py's VllmCore)."""

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

    @property
    def adopts_weights(self) -> bool:
        """Whether update_weights(adopt=True) keeps the given tensors (the weight receiver then double-buffers)."""
        return getattr(self.engine, "adopts_weights", True)

    @property
    def serves_adapters_unmerged(self) -> bool:
        """Whether LoRA adapters in an update become resident versions (LLMEngine.serves_adapters_unmerged)."""
        return self.engine.serves_adapters_unmerged

    def adapter_problem(self, weight: str) -> str | None:
        return self.engine.adapter_problem(weight)

    def parameter_layout(self) -> Layout:
        """name -> (shape, dtype) of every parameter a weight update may carry."""
        return self.engine.parameter_layout()

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, images: Sequence[ImageInput] = ()
    ) -> AsyncIterator[Completion]:
        """Yield deltas of the request's n completions as the engine produces them.

        Raises InvalidRequest / QueueFull / DuplicateRequest on the first iteration when the engine
        refuses the request. Leaving the iteration early (a client gone) aborts the request, which
        frees its KV blocks.
        """
        prompt = list(prompt_ids)
        async for delta in self._stream(request_id, params.n,
                                        lambda: self.engine.add_request(request_id, prompt, params, images)):
            yield delta

    async def _stream(self, request_id: str, n: int, add: Callable[[], None]) -> AsyncIterator[Completion]:
        """Run `add` (queues request `request_id`) on the engine thread, then yield its n completions' deltas."""
        stream = Stream(asyncio.get_running_loop(), asyncio.Queue())
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

    async def prefill_for_transfer(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                                   images: Sequence[ImageInput] = ()) -> PrefilledPrompt:
        """Prefill the prompt (with its images) once between two steps, sample each completion's first token, and
        export the prompt's KV (rollout/engine/kv_handoff.py); raises like generate(). Calls that wait together run as
        one prefill batch (up to max_num_batched_tokens of prompt)."""
        prompt = list(prompt_ids)
        done: Future = Future()
        await self._call(lambda: self._transfer_prefills.append((request_id, prompt, params, list(images), done)))
        return await asyncio.wait_for(asyncio.wrap_future(done), self.command_timeout_s)

    def _run_transfer_prefills(self) -> None:
        """The queued prefill_for_transfer calls, in batches of at most max_num_batched_tokens prompt tokens."""
        pending, self._transfer_prefills = self._transfer_prefills, []
        for batch in budget_batches(pending, self.engine.config.max_num_batched_tokens):
            try:
                results = prefill_many_for_transfer(self.engine, [request[:-1] for request in batch])
            except Exception as exc:  # noqa: BLE001 - the batch's callers learn why; the loop goes on
                results = [exc] * len(batch)
            for (*_, done), result in zip(batch, results):
                if done.set_running_or_notify_cancel():
                    (done.set_exception if isinstance(result, Exception) else done.set_result)(result)

    async def generate_prefilled(self, request_id: str, prefilled: PrefilledPrompt, params: SamplingParams,
                                 images: Sequence[ImageInput] = ()) -> AsyncIterator[Completion]:
        """Like generate(), for a request whose prompt KV and first tokens were computed elsewhere (the first
        delta carries the first tokens; `images`: the prompt's, as the prefill had them). Raises like generate(), and KVTransferInvalid, KVWeightVersionMismatch,
        QueueFull when the KV blocks are not free now (rollout/engine/kv_handoff.py)."""
        async for delta in self._stream(request_id, params.n,
                                        lambda: add_prefilled_request(self.engine, request_id, prefilled, params,
                                                                      list(images))):
            yield delta

    async def generate_all(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                           images: Sequence[ImageInput] = ()) -> list[Completion]:
        """The request's n completions, in index order, once all have finished (an abort keeps partial output): one
        hand-over per request, not per step. Raises like generate(); cancelling the wait aborts the request."""
        return (await self.generate_all_many([(request_id, prompt_ids, params, images)]))[0]

    async def generate_all_many(self, requests: Sequence[tuple[str, Sequence[int], SamplingParams]
                                                         | tuple[str, Sequence[int], SamplingParams, Sequence[ImageInput]]]
                                ) -> list[list[Completion]]:
        """generate_all of each (request id, prompt ids, params[, images]), added by one command: they start in the
        same step, in their order, whatever the engine thread was doing, so the same requests are batched (and
        computed) alike every time. A refusal raises like generate_all, its `request_index` naming the request; the
        rest are aborted."""
        return await self._whole([(request_id, functools.partial(self.engine.add_request, request_id, list(prompt),
                                                                 params, *images))
                                  for request_id, prompt, params, *images in requests])

    async def _whole(self, adds: list[tuple[str, Callable[[], None]]]) -> list[list[Completion]]:
        """Run each (request id, add) on the engine thread in one command; then each request's completions at once."""
        streams = [Stream(asyncio.get_running_loop(), asyncio.Queue(), whole=True) for _ in adds]
        done: list[list[Completion]] = []
        try:
            await self._call(lambda: self._add_all(adds, streams))
            for stream in streams:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                done.append(item)
            return done
        finally:
            if unfinished := list(zip(adds, streams))[len(done):]:
                self._submit(lambda: [self._abort_stream(request_id, stream) for (request_id, _), stream in unfinished])

    async def compute_logprobs(
        self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]], temperature: float = 1.0,
        images: Sequence[ImageInput] = (),
    ) -> tuple[list[list[float]], int]:
        """Logprobs of each response's tokens given the prompt (with its images) under softmax(logits /
        temperature), and the weight version used (between two steps)."""
        return await self._call(lambda: (self.engine.compute_logprobs(prompt_ids, responses, temperature, images),
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

    async def open_session(self, session_id: str, prompt_ids: Sequence[int], images: Sequence[ImageInput] = ()) -> int:
        """Open a session on its initial context (with its images); returns the context length. Under
        engine.session_admission kv it waits in the admission queue (asking again every _ADMISSION_POLL_S) until it
        is admitted."""
        prompt = list(prompt_ids)
        try:
            while True:
                try:
                    return await self._call(lambda: self.engine.open_session(session_id, prompt, images))
                except NotAdmitted:
                    await asyncio.sleep(_ADMISSION_POLL_S)
        except asyncio.CancelledError:  # the caller gave up: it leaves the queue
            self._commands.put((lambda: self.engine.sessions.admission.forget(session_id), Future()))
            raise

    async def append_to_session(self, session_id: str, token_ids: Sequence[int], turn_reward: float | None = None,
                                images: Sequence[ImageInput] = ()) -> int:
        """Append observation tokens (loss mask 0, with their images); returns the context length."""
        tokens = list(token_ids)
        return await self._call(lambda: self.engine.append_to_session(session_id, tokens, turn_reward, images))

    async def generate_in_session(self, session_id: str, params: SamplingParams, whole: bool = False,
                                  expected_idle_s: float | None = None) -> AsyncIterator[Completion]:
        """Yield the deltas of the session's next turn (index 0), like generate(), or with `whole` the turn in one
        delta once it has finished (one hand-over instead of one per step); leaving early aborts the turn.
        `expected_idle_s`: how long the caller's tool will take after the turn (engine.session_policy)."""
        request_id = f"session/{session_id}/{uuid.uuid4().hex[:8]}"

        def add() -> None:
            self.engine.add_session_request(request_id, session_id, params, expected_idle_s)

        if whole:
            yield (await self._whole([(request_id, add)]))[0][0]
            return
        async for delta in self._stream(request_id, 1, add):
            yield delta

    async def session_state(self, session_id: str) -> SessionState:
        return await self._call(lambda: self.engine.session_state(session_id))

    async def session_tool(self, session_id: str, tool: str) -> None:
        """The session's last turn called `tool` (engine.session_policy learns waits per tool)."""
        await self._call(lambda: self.engine.session_tool(session_id, tool))

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

    def _close_session(self, session_id: str) -> SessionRecord:
        request_id = self.engine.session_turn(session_id)
        if request_id is not None:
            self._abort(request_id)  # its stream hears the abort
        return self.engine.close_session(session_id)

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
