"""SGLang behind the engine interface: `sglang.Engine` as the rollout worker (GPU only: its kernels are CUDA's).

SGLang runs its scheduler in its own processes and is asyncio-native, so this adapter awaits its tokenizer
manager in the server's event loop (the Engine is made inside that loop; its blocking methods would nest
loops). Written against SGLang's Engine API (sglang 0.5): `async_generate(input_ids=..., return_logprob=True,
stream=True)` whose chunks carry cumulative `meta_info.output_token_logprobs` as (logprob, token id, text);
`tokenizer_manager.abort_request(rid)`; the weight-update calls below. Tests: tests/test_engine_sglang.py,
marked gpu (not run yet: no GPU where this was written).

- Weights (tensor_parallel_size 1): SGLang's scheduler joins the trainer's group itself
  (`init_weights_update_group`, rank_offset = the rank the trainer gave this worker) and receives every tensor
  into GPU memory in one `update_weights_from_distributed` call (one broadcast per tensor, as the trainer sends
  to such a group; the received copy costs GPU memory the size of the weights while it loads), radix cache
  flushed. SGLang loads them when they have all arrived and waits for in-flight requests to end first (its model
  update lock), so tokens are tagged with the new version from CommitUpdate on, shortly after they use it. A
  receive that fails may leave the weights partly updated (SGLang says so): the next publish sends them whole.
  With tensor_parallel_size > 1 each TP worker would take a rank of its own, which the trainer's groups (one rank
  per receiver) do not give: there the rollout service stages the tensors and hands them over with
  `update_weights_from_tensor`.

- Logprobs are taken to be of softmax(logits / T), SGLang's default for sampled tokens (unless
  SGLANG_RETURN_ORIGINAL_LOGPROB is set); not yet checked on a GPU at T != 0.
- Versions: SGLang switches weights under its own lock; a token is tagged with the version served when its
  chunk arrived here, so a token computed just before a switch but delivered after it may carry the new one.
- n completions are n requests (`{request_id}/{i}`) whose prompt SGLang's radix cache shares.
- Sessions keep their tokens here (rollout/engine/sessions.py's table without blocks); a turn sends the whole
  context and the radix cache supplies the earlier turns' KV.
- LoRA unmerged (rollout/engines/sglang_weights.py): the rollout service stages every update (SGLang joins no group),
  W goes through update_weights_from_tensor, adapters through load_lora_adapter_from_tensors; requests are pinned to
  their version's adapter. Merged with tensor_parallel_size 1, adapters are refused at BeginUpdate.
- PD: `disaggregation_mode` prefill / decode makes this worker one side of SGLang's own split.
"""

import asyncio
import contextlib
import itertools
import json
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import torch

from rollout.config import read_eos_token_ids
from rollout.engine.errors import DuplicateRequest, EngineDead, InvalidRequest
from rollout.engine.model_info import Layout, ModelInfo
from rollout.engine.outputs import Completion
from rollout.engine.sampling_params import SamplingParams, logprobs_temperature, validate_prompt
from rollout.engine.sequence import FinishReason
from rollout.engine.session_steps import append_checked, open_checked, turn_params
from rollout.engine.sessions import SessionRecord, SessionState, SessionTable
from rollout.engines.base import KeepsItsOwnSessionKV, checkpoint_layout, generate_each
from rollout.engines.settings import SglangSettings
from rollout.engines.sglang_weights import SglangAdapters, SglangWeights, adapter_name, lora_server_args

log = logging.getLogger(__name__)
_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class _Turn:
    """What the session table needs of a running turn (rollout/engine/sessions.py reads these fields)."""

    def __init__(self, request_id: str, prompt: list[int]):
        self.request_id = request_id
        self.token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.logprobs: list[float] = []
        self.weight_versions: list[int] = []
        self.block_table: list[int] = []
        self.num_cached_tokens = len(prompt)  # the radix cache holds it
        self.finish_reason: FinishReason | None = None
        self.session = None
        self.context_version = self.stale_kv_version = None  # unknown: SGLang's KV versions are not reported

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class SglangEngine(KeepsItsOwnSessionKV, SglangWeights):
    """The engine interface (rollout/engines/base.py) over `sglang.Engine`; make it inside the event loop."""

    def __init__(self, model: str, settings: SglangSettings):
        import sglang

        self.model = model
        self.settings = settings
        self.sgl = sglang.Engine(**server_args(model, settings))
        raw = json.loads((Path(model) / "config.json").read_text())
        max_len = settings.max_model_len or raw.get("max_position_embeddings", 4096)
        self.info = ModelInfo("sglang", raw["vocab_size"], max_len, read_eos_token_ids(Path(model), raw),
                              "tempered", settings.session_idle_timeout_s)
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            settings.dtype if settings.dtype != "auto" else str(raw.get("torch_dtype", "bfloat16")), torch.bfloat16)
        self.weight_version = 0
        self.last_pause_s = 0.0  # the scheduler loads an update_weights call's tensors between its batches: all of it
        self.sessions = SessionTable(None, max_len, settings.max_sessions, settings.session_idle_timeout_s)
        self._running: dict[str, list[str]] = {}  # request id -> SGLang rids
        self._version_changed = asyncio.Event()
        self._seed_rng = random.Random(settings.seed)
        self._ids = itertools.count()
        self._stopped = False
        self._tokenizer = None
        self.adapters = (SglangAdapters(self.sgl.tokenizer_manager, settings) if settings.lora.mode == "unmerged"
                         else None)
        # SGLang joins the trainer's group itself, unless the update's adapters must reach load_lora_adapter_from_tensors
        self.receives_from_group = settings.tensor_parallel_size == 1 and self.adapters is None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model)
        return self._tokenizer

    @property
    def stats(self) -> dict[str, int | float]:
        return {"running": len(self._running), "sessions": len(self.sessions.sessions),
                "sessions_expired": self.sessions.num_expired}

    @property
    def device(self) -> torch.device:
        """Where received weights are staged before update_weights_from_tensor hands them to SGLang's workers
        (tensor_parallel_size > 1; otherwise SGLang receives them itself)."""
        return torch.device("cpu")

    def parameter_layout(self) -> Layout:
        """The checkpoint's tensors (Hugging Face names) in the served dtype."""
        return checkpoint_layout(self.model, self.dtype)

    # ---- generation

    async def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
                       ) -> AsyncIterator[Completion]:
        prompt = [int(t) for t in prompt_ids]
        validate_prompt(prompt, self.info.vocab_size)
        params.validate(prompt_len=len(prompt), vocab_size=self.info.vocab_size,
                        max_model_len=self.info.max_model_len, max_n=self.settings.max_n)
        async for delta in self._stream(request_id, prompt, params):
            yield delta

    async def _stream(self, request_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[Completion]:
        if self._stopped:
            raise EngineDead("the SGLang engine was shut down")
        if request_id in self._running:
            raise DuplicateRequest(f"request_id: {request_id!r} is already running")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        rids = [f"{request_id}/{i}" for i in range(params.n)]
        self._running[request_id] = rids
        pinned = self.adapters.pin(request_id, self.weight_version) if self.adapters is not None else None
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pump(i, rid, prompt, params, seed + i, queue, pinned))
                 for i, rid in enumerate(rids)]
        unfinished = set(range(params.n))
        try:
            while unfinished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finish_reason is not None:
                    unfinished.discard(item.index)
                yield item
        finally:
            self._running.pop(request_id, None)
            for rid, task in zip(rids, tasks):
                if not task.done():
                    self.sgl.tokenizer_manager.abort_request(rid)
                    task.cancel()
            if pinned is not None:
                asyncio.ensure_future(self.adapters.release(request_id))

    async def _pump(self, index: int, rid: str, prompt: list[int], params: SamplingParams, seed: int,
                    queue: asyncio.Queue, pinned: int | None = None) -> None:
        """One completion's chunks into `queue` as deltas (SGLang's chunks are cumulative); `pinned`: the adapter
        version it runs on (its tokens carry it), None: W alone, its tokens the version served when they arrive."""
        try:
            lora = {"lora_path": adapter_name(pinned)} if pinned is not None else {}
            stream = await self.sgl.async_generate(input_ids=prompt, sampling_params=_sampling(params, seed),
                                                   return_logprob=True, stream=True, rid=rid, **lora)
            seen = 0
            async for chunk in stream:
                meta = chunk["meta_info"]
                new = meta["output_token_logprobs"][seen:]
                seen += len(new)
                finish = meta.get("finish_reason")
                reason = _FINISH_REASONS.get(finish["type"]) if finish else None
                queue.put_nowait(Completion(index, [int(t) for _, t, _ in new], [float(lp) for lp, _, _ in new],
                                            [self.weight_version if pinned is None else pinned] * len(new),
                                            reason))
        except Exception as exc:  # noqa: BLE001 - the stream's reader learns why
            queue.put_nowait(exc)

    async def generate_all(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
                           ) -> list[Completion]:
        done = [Completion(i) for i in range(params.n)]
        async for delta in self.generate(request_id, prompt_ids, params):
            _extend(done[delta.index], delta)
        return done

    async def generate_all_many(self, requests: Sequence[tuple[str, Sequence[int], SamplingParams]]
                                ) -> list[list[Completion]]:
        return await generate_each(self, requests)  # SGLang's scheduler batches them as they arrive

    async def abort(self, request_id: str) -> bool:
        rids = self._running.get(request_id)
        if rids is None:
            session = self.sessions.sessions.get(request_id)
            turn = session.turn if session is not None else None
            rids = self._running.get(turn.request_id) if turn is not None else None
        for rid in rids or []:
            self.sgl.tokenizer_manager.abort_request(rid)
        return rids is not None

    async def compute_logprobs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]],
                               temperature: float = 1.0) -> tuple[list[list[float]], int]:
        """SGLang's input-token logprobs of prompt + response (raw), renormalized at the temperature from the
        whole vocabulary's when it is not 1."""
        if not temperature > 0:
            raise InvalidRequest("temperature", f"must be > 0, got {temperature}")
        version = self.weight_version
        results = []
        for response in responses:
            rows = await self._input_logprobs(prompt_ids, response, self.info.vocab_size if temperature != 1 else 0)
            if temperature == 1.0:
                results.append([float(lp) for lp, _, _ in rows["input_token_logprobs"]])
            else:
                results.append([float(_tempered(top, temperature)[token]) for top, token in
                                zip(rows["input_top_logprobs"], response)])
        return results, version

    async def top_logprobs(self, prompt_ids: Sequence[int], response_ids: Sequence[int], temperature: float,
                           top: int) -> list[list[tuple[int, float]]]:
        rows = await self._input_logprobs(prompt_ids, response_ids, self.info.vocab_size)
        out = []
        for entry in rows["input_top_logprobs"]:
            values, ids = torch.topk(_tempered(entry, temperature), top)
            out.append(list(zip(ids.tolist(), values.tolist())))
        return out

    async def _input_logprobs(self, prompt_ids, response, top: int) -> dict:
        prompt, tokens = [int(t) for t in prompt_ids], [int(t) for t in response]
        validate_prompt(prompt, self.info.vocab_size)
        if not tokens:
            return {"input_token_logprobs": [], "input_top_logprobs": []}
        adapted = self.adapters is not None and self.weight_version in self.adapters.versions.resident
        lora = {"lora_path": adapter_name(self.weight_version)} if adapted else {}  # the served version's adapter
        out = await self.sgl.async_generate(input_ids=prompt + tokens, sampling_params={"max_new_tokens": 0},
                                            return_logprob=True, logprob_start_len=len(prompt),
                                            top_logprobs_num=top or None, **lora)
        return out["meta_info"]

    async def watch_version(self, newer_than: int, wait_s: float) -> int:
        deadline = time.monotonic() + wait_s
        while self.weight_version == newer_than and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._version_changed.wait(), left)
        return self.weight_version

    # ---- sessions

    async def open_session(self, session_id: str, prompt_ids: Sequence[int]) -> int:
        self.sessions.expire()
        return open_checked(self.sessions, self.info, session_id, prompt_ids)

    async def append_to_session(self, session_id: str, token_ids: Sequence[int],
                                turn_reward: float | None = None) -> int:
        return append_checked(self.sessions, self.info, session_id, token_ids, self.weight_version, turn_reward)

    async def generate_in_session(self, session_id: str, params: SamplingParams, whole: bool = False,
                                  expected_idle_s: float | None = None) -> AsyncIterator[Completion]:
        session = self.sessions.idle(session_id)
        params = turn_params(session, params, self.info)
        turn = _Turn(f"session/{session_id}/{uuid.uuid4().hex[:8]}", session.token_ids)
        self.sessions.start_turn(session, turn, logprobs_temperature("tempered", params.temperature))
        done = Completion(0)
        try:
            async for delta in self._stream(turn.request_id, turn.token_ids, params):
                _extend(done, delta)
                if not whole:
                    yield delta
        finally:
            turn.token_ids += done.token_ids
            turn.logprobs, turn.weight_versions = done.logprobs, done.weight_versions
            turn.finish_reason = done.finish_reason or FinishReason.ABORT
            if turn.session is not None:  # not already ended by close_session's deadline
                self.sessions.end_turn(turn)
        if whole:
            yield done

    async def session_state(self, session_id: str) -> SessionState:
        return self.sessions.state(session_id, self.weight_version)

    async def close_session(self, session_id: str) -> SessionRecord:
        """Close a session. A running turn is aborted, and its stream ends it once the abort lands; if that has
        not happened within `abort_timeout_s`, the turn is ended here as aborted and the session closed."""
        session = self.sessions.get(session_id)
        deadline = time.monotonic() + self.settings.abort_timeout_s
        pause = 0.01
        while session.turn is not None and time.monotonic() < deadline:
            await self.abort(session_id)
            await asyncio.sleep(min(pause, max(deadline - time.monotonic(), 0)))
            pause = min(2 * pause, 0.5)
        if session.turn is not None:
            turn = session.turn
            log.warning("session %s: SGLang did not end its turn %s within %.1f s of the abort; closing it anyway",
                        session_id, turn.request_id, self.settings.abort_timeout_s)
            self._running.pop(turn.request_id, None)
            turn.finish_reason = FinishReason.ABORT
            self.sessions.end_turn(turn)
        return self.sessions.close(session_id)

    def shutdown(self, timeout_s: float = 10.0) -> None:
        self._stopped = True
        self.sgl.shutdown()


def server_args(model: str, settings: SglangSettings) -> dict:
    """sglang.Engine keyword arguments (ServerArgs) of the settings; engine_args last: they override."""
    args = {"model_path": model, "dtype": settings.dtype, "context_length": settings.max_model_len,
                "max_running_requests": settings.max_num_seqs, "mem_fraction_static": settings.mem_fraction_static,
                "tp_size": settings.tensor_parallel_size, "kv_cache_dtype": settings.kv_cache_dtype,
                "random_seed": settings.seed, "disaggregation_mode": settings.disaggregation_mode,
                "disaggregation_transfer_backend": settings.disaggregation_transfer_backend}
    return {**args, **lora_server_args(settings), **settings.engine_args}


def _sampling(params: SamplingParams, seed: int) -> dict:
    return {"temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else -1, "max_new_tokens": params.max_tokens,
            "stop_token_ids": list(params.stop_token_ids), "stop": list(params.stop), "ignore_eos": params.ignore_eos,
            "sampling_seed": seed % 2**63}


def _extend(completion: Completion, delta: Completion) -> None:
    completion.token_ids += delta.token_ids
    completion.logprobs += delta.logprobs
    completion.weight_versions += delta.weight_versions
    completion.finish_reason = delta.finish_reason


def _tempered(top: list, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) over the vocabulary from SGLang's whole-vocabulary (logprob, id, text) at T = 1."""
    ids = torch.tensor([t for _, t, _ in top])
    dense = torch.full((int(ids.max()) + 1,), float("-inf"), dtype=torch.float64)
    dense[ids] = torch.tensor([lp for lp, _, _ in top], dtype=torch.float64)
    return torch.log_softmax(dense / temperature, dim=0)
