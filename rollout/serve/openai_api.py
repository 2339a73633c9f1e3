"""An OpenAI-compatible HTTP endpoint (FastAPI + uvicorn) over the rollout service's engine (rollout/engines/base.py).

It runs in the rollout service's process and asyncio loop (serve_openai), so its requests share the
engine's batches and limits with gRPC. Routes: GET /v1/models, POST /v1/completions and
/v1/chat/completions (`stream: true`: server-sent events), and per session POST
/v1/sessions/{id}/reward and /v1/sessions/{id}/close. Every choice carries `token_ids` and
`weight_versions` beside OpenAI's fields. A chat call with a session key (X-Session-Id, or the API key
when `session_by_key`) runs as the next turn of that engine session (rollout/serve/openai_sessions.py).
Refusals keep OpenAI's error body: a bad request 4xx, a full queue 429 and a stopped engine 503, the
last two with Retry-After (the openai client retries them by itself).
"""

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException

from protos.codec import CodecError
from rollout.engine.errors import (
    ContextFull,
    DuplicateRequest,
    EngineDead,
    InvalidRequest,
    QueueFull,
    SessionBusy,
    SessionNotFound,
)
from rollout.engine.outputs import Completion
from rollout.engine.sampling_params import SamplingParams, logprobs_temperature
from rollout.engine.sessions import SessionRecord
from rollout.engines.base import RolloutEngine
from rollout.serve.chat import NoChatTemplate, render_continuation, render_prompt
from rollout.serve.http_server import OpenAIServer, start_http
from rollout.serve.images import ImageReader, ReadImage, read_data_urls
from rollout.serve.openai_output import FINISH_REASONS, Choice, Reply, error_body, sse
from rollout.serve.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    CloseRequest,
    CompletionRequest,
    OpenAISettings,
    RewardRequest,
)
from rollout.serve.openai_sessions import (
    ChatSession,
    HistoryDiverged,
    SessionBook,
    expected_idle,
    session_key,
)
from rollout.serve.tool_calls import ToolCallParser

log = logging.getLogger(__name__)

# (record, reward, group_id, group_size) -> whether the buffer stored the sample
Submit = Callable[[SessionRecord, float, str, int], Awaitable[bool]]


class APIError(Exception):
    """A refusal with its HTTP status, in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


_KINDS = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}
# engine refusal -> (status, code); rollout/engine/errors.py names the gRPC status each stands for
_REFUSALS = (
    (InvalidRequest, 400, "invalid_argument"),
    (ContextFull, 400, "out_of_range"),
    (HistoryDiverged, 400, "history_diverged"),
    (SessionNotFound, 404, "not_found"),
    (SessionBusy, 409, "failed_precondition"),
    (NoChatTemplate, 409, "failed_precondition"),
    (DuplicateRequest, 409, "already_exists"),
    (QueueFull, 429, "resource_exhausted"),
    (EngineDead, 503, "unavailable"),
    (TimeoutError, 503, "unavailable"),  # the engine thread did not take a command in time
)
_NO_ANSWER = "the rollout engine did not answer in time"  # TimeoutError's message is empty


def create_app(engine: RolloutEngine, tokenizer, model_name: str, settings: OpenAISettings,
               submit: Submit | None = None, images: ImageReader | None = None) -> FastAPI:
    """The FastAPI app over `engine`; `submit` puts a closed session's sample into the buffer (None: no buffer);
    `images` reads image_url parts (a vision-language model; None: they are refused)."""
    api = _Endpoint(engine, tokenizer, settings.served_model_name or model_name, settings, submit, images)
    app = FastAPI(title="relayrl rollout (OpenAI-compatible)", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_exception_handler(APIError, api.on_api_error)
    app.add_exception_handler(RequestValidationError, api.on_invalid_body)
    app.add_exception_handler(HTTPException, api.on_http_error)
    for kind, _, _ in _REFUSALS:
        app.add_exception_handler(kind, api.on_refusal)
    app.get("/v1/models")(api.models)
    app.post("/v1/completions")(api.completions)
    app.post("/v1/chat/completions")(api.chat_completions)
    app.post("/v1/sessions/{session_id}/reward")(api.set_reward)
    app.post("/v1/sessions/{session_id}/close")(api.close_session)
    return app


class _Endpoint:
    """The routes and what they share: the engine, the tokenizer, the sessions chat calls drive."""

    def __init__(self, engine: RolloutEngine, tokenizer, model_name: str, settings: OpenAISettings,
                 submit: Submit | None, images: ImageReader | None = None):
        self.engine, self.tokenizer, self.model_name, self.settings, self.submit = (
            engine, tokenizer, model_name, settings, submit)
        self.images = images  # reads image_url parts (a vision-language model); None: they are refused
        self.max_model_len = engine.info.max_model_len
        self.eos_token_ids = set(engine.info.eos_token_ids)
        self.book = SessionBook(engine.info.session_idle_timeout_s)
        self.created = int(time.time())

    # ---- routes

    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "relayrl", "max_model_len": self.max_model_len}]}

    async def completions(self, body: CompletionRequest, request: Request):
        self._check_model(body.model)
        if request.headers.get("x-session-id"):
            raise APIError(400, "a session holds a chat conversation: send its calls to /v1/chat/completions",
                           "X-Session-Id")
        if body.logprobs and body.stream:
            raise APIError(400, "logprobs: top-k alternatives are not streamed; ask without stream", "logprobs")
        if body.logprobs and body.logprobs > self.settings.max_logprobs:
            raise APIError(400, f"logprobs: at most {self.settings.max_logprobs} alternatives are served "
                           "(openai.max_logprobs)", "logprobs")
        prompt = self.tokenizer(body.prompt).input_ids if isinstance(body.prompt, str) else body.prompt
        reply = self._reply(f"cmpl-{uuid.uuid4().hex}", body, len(prompt), body.logprobs is not None, chat=False)
        deltas = self.engine.generate(reply.id, prompt, self._params(body, body.max_tokens, len(prompt)))
        result = await self._respond(reply, deltas, body)
        if body.logprobs:
            for choice, out in zip(reply.choices, result["choices"]):
                out["logprobs"]["top_logprobs"] = await self._top_logprobs(prompt, choice.token_ids, body)
        return result

    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._check_model(body.model)
        key = session_key(request.headers, self.settings.session_by_key)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        urls = [url for message in body.messages for url in message.image_urls]
        if key is None:
            images, marker = self._read_images(urls)
            prompt = self._render(render_prompt, [m.for_template(marker) for m in body.messages], body.tools)
            prompt = self.images.expand(prompt, images) if images else prompt
            reply = self._reply(f"chatcmpl-{uuid.uuid4().hex}", body, len(prompt), body.logprobs, chat=True)
            deltas = self.engine.generate(reply.id, prompt, self._params(body, max_tokens, len(prompt)),
                                          **_engine_images(images))
            return await self._respond(reply, deltas, body)
        if body.n != 1:
            raise APIError(400, "n: a session turn generates one completion (n must be 1)", "n")
        try:
            idle_s = expected_idle(request.headers)
        except ValueError as exc:
            raise APIError(400, str(exc), "x-session-expected-idle-s") from exc
        session, keys, added = await self._advance(key, body)
        reply = self._reply(f"chatcmpl-{uuid.uuid4().hex}", body, len(added), body.logprobs, chat=True)
        deltas = self.engine.generate_in_session(key, self._params(body, max_tokens, 0), expected_idle_s=idle_s)
        return await self._respond(reply, deltas, body, lambda: self._record_reply(session, keys, reply.choices[0]))

    async def set_reward(self, session_id: str, body: RewardRequest) -> dict:
        if body.turn_reward is not None:
            num_tokens = await self.engine.append_to_session(session_id, [], body.turn_reward)
        else:
            num_tokens = (await self.engine.session_state(session_id)).num_tokens
        if body.reward is not None:
            session = self.book.get(session_id) or self.book.add(session_id, None)
            session.reward = body.reward
        return {"session_id": session_id, "num_tokens": num_tokens}

    async def close_session(self, session_id: str, body: CloseRequest) -> dict:
        if body.submit and self.submit is None:
            raise APIError(409, "submit: this rollout service has no buffer configured", "submit",
                           "failed_precondition")
        session = self.book.pop(session_id)
        record = await self.engine.close_session(session_id)
        reward = body.reward
        if reward is None:
            reward = session.reward if session is not None and session.reward is not None else 0.0
        submitted = await self.submit(record, reward, body.group_id, body.group_size) if body.submit else False
        return {
            "session_id": session_id, "reward": reward, "submitted": submitted,
            "prompt_ids": record.prompt_ids, "response_ids": record.response_ids, "loss_mask": record.loss_mask,
            "logprobs": record.logprobs, "weight_versions": record.weight_versions, "kv_version": record.kv_version,
            "turn_rewards": record.turn_rewards, "temperature": record.temperature,
            "routed_experts": record.routed_experts.tolist() if record.routed_experts is not None else None,
            "finish_reason": FINISH_REASONS.get(record.finish_reason),
            "stats": {"turns": record.turns, "prefill_tokens": record.prefill_tokens,
                      "turn_prefill_tokens": record.turn_prefill_tokens, "kv_recomputes": record.kv_recomputes},
            **({"images": [{"sha256": image.hash.hex(), "media_type": image.media_type, "grid_thw": list(image.grid_thw),
                            "num_tokens": image.num_tokens(self.images.merge_size)} for image in record.images]}
               if record.images else {}),
        }

    # ---- sessions

    async def _advance(self, key: str, body: ChatCompletionRequest) -> tuple[ChatSession, list[tuple], list[int]]:
        """Bring engine session `key` up to the call's messages: open it on the first call, else append the
        messages after those it holds. Returns the session, the call's message keys and the tokens added."""
        keys = [m.key() for m in body.messages]
        session = self.book.get(key)
        if session is None:
            images, marker = self._read_images([url for m in body.messages for url in m.image_urls])
            added = self._render(render_prompt, [m.for_template(marker) for m in body.messages], body.tools)
            added = self.images.expand(added, images) if images else added
            num_tokens = await self.engine.open_session(key, added, **_engine_images(images))
            return self.book.add(key, keys, num_tokens), keys, added
        if session.history is None:
            raise APIError(409, f"session {key!r} was not opened by a chat call; chat calls drive the sessions "
                           "they open", code="failed_precondition")
        try:
            state = await self.engine.session_state(key)
        except SessionNotFound:
            self.book.pop(key)
            raise
        if state.busy:
            raise SessionBusy(f"session {key!r} is running a turn; one call at a time")
        session.check_tokens(state.num_tokens)
        start = session.new_messages(keys)
        if start is None:  # a retry of a turn that did not run
            return session, keys, []
        images, marker = self._read_images([url for m in body.messages[start:] for url in m.image_urls])
        added = self._render(render_continuation, [m.for_template(marker) for m in body.messages[start:]],
                             session.turn_closed, body.tools)
        added = self.images.expand(added, images) if images else added
        held = session.history, session.awaiting_reply
        session.history, session.awaiting_reply = keys, True  # before the await: a concurrent retry appends nothing
        try:
            session.num_tokens = await self.engine.append_to_session(key, added, **_engine_images(images))
        except BaseException:
            session.history, session.awaiting_reply = held
            raise
        return session, keys, added

    def _record_reply(self, session: ChatSession, keys: list[tuple], choice: Choice) -> None:
        """Once a turn has run: the reply as this endpoint returned it joins the session's history."""
        if choice.token_ids:
            content, calls = choice.content_and_calls()
            reply = ChatMessage(role="assistant", content=content, tool_calls=[c.to_openai() for c in calls] or None)
            session.replied(keys, reply.key(), len(choice.token_ids), choice.token_ids[-1] in self.eos_token_ids)

    async def _top_logprobs(self, prompt: list[int], token_ids: list[int], body: CompletionRequest) -> list[dict]:
        """Per generated token, its `body.logprobs` most likely alternatives {text: logprob}, from one scoring pass
        under the temperature the sampled tokens' logprobs use (the top-k / top-p cut is not applied)."""
        temperature = logprobs_temperature(self.engine.info.logprobs_mode, body.temperature)
        rows = await self.engine.top_logprobs(prompt, token_ids, temperature, body.logprobs)
        tops = []
        for row in rows:
            top: dict[str, float] = {}
            for token_id, logprob in row:  # most likely first; two ids with one text keep the likelier
                top.setdefault(self.tokenizer.decode([token_id]), logprob)
            tops.append(top)
        return tops

    # ---- shared

    def _read_images(self, urls: list[str]) -> tuple[list[ReadImage], str]:
        """The images of a call's image_url parts (data: URIs), and the text each part is written as in the prompt
        (the model's image placeholder); ([], "") without parts. A part refused: 400 naming it."""
        if not urls:
            return [], ""
        try:
            images = read_data_urls(self.images, urls, self.engine.info.engine)
        except CodecError as exc:
            raise APIError(400, f"messages: {exc}", "messages") from None
        return images, self.images.placeholder(self.tokenizer)

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} is not served here; GET /v1/models lists {self.model_name!r}",
                           "model", "model_not_found")

    def _render(self, render: Callable, messages: list[dict], *args) -> list[int]:
        """Messages -> token ids with the chat template; what the template refuses is a 400."""
        try:
            return render(self.tokenizer, messages, *args)
        except NoChatTemplate:
            raise
        except (ValueError, TemplateError) as exc:
            raise APIError(400, f"messages: {exc}", "messages") from exc

    def _params(self, body, max_tokens: int | None, prompt_len: int) -> SamplingParams:
        """max_tokens None: the context left (in a session the engine cuts max_tokens to what is left)."""
        return SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            max_tokens=max_tokens if max_tokens is not None else max(1, self.max_model_len - prompt_len),
            stop_token_ids=tuple(body.stop_token_ids), stop=body.stop_strings, n=body.n, seed=body.seed,
            ignore_eos=body.ignore_eos,
        )

    def _reply(self, reply_id: str, body, prompt_tokens: int, with_logprobs: bool, chat: bool) -> Reply:
        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=True)

        parser = chat and body.parses_tool_calls
        choices = [Choice(i, decode, body.stop_strings, ToolCallParser() if parser else None) for i in range(body.n)]
        return Reply(reply_id, "chat.completion" if chat else "text_completion", self.model_name, prompt_tokens,
                     choices, with_logprobs, chat)

    async def _respond(self, reply: Reply, deltas: AsyncIterator[Completion], body,
                       on_done: Callable[[], None] | None = None):
        """Run the generation: the whole reply as JSON, or server-sent events when the request streams.

        The first delta is awaited here either way, so an engine refusal is an HTTP status, not an event.
        `on_done` runs once the generation has ended, however it ended.
        """
        try:
            first = await anext(deltas)
        except BaseException:
            if on_done is not None:
                on_done()
            raise
        if body.stream:
            return StreamingResponse(self._events(reply, first, deltas, body.include_usage, on_done),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        async with contextlib.aclosing(deltas):  # leaving early aborts the request
            try:
                reply.take(first)
                async for delta in deltas:
                    reply.take(delta)
            finally:
                if on_done is not None:
                    on_done()
        return reply.body()

    async def _events(self, reply: Reply, first: Completion, deltas: AsyncIterator[Completion],
                      include_usage: bool, on_done: Callable[[], None] | None) -> AsyncIterator[str]:
        async with contextlib.aclosing(deltas):  # a client gone aborts the request
            try:
                yield sse(reply.chunk(reply.take(first)))
                async for delta in deltas:
                    yield sse(reply.chunk(reply.take(delta)))
                if include_usage:
                    yield sse(reply.usage_chunk())
            except (EngineDead, TimeoutError) as exc:  # mid-stream: the status line has gone out already
                yield sse(error_body(str(exc) or _NO_ANSWER, _KINDS[503], code="unavailable"))
            finally:
                if on_done is not None:
                    on_done()
        yield "data: [DONE]\n\n"

    # ---- errors

    async def on_api_error(self, request: Request, exc: APIError) -> JSONResponse:
        return self._error(exc.status, exc.message, exc.param, exc.code)

    async def on_refusal(self, request: Request, exc: Exception) -> JSONResponse:
        status, code = next((s, c) for kind, s, c in _REFUSALS if isinstance(exc, kind))
        param = getattr(exc, "field", None)
        message = (str(exc) or _NO_ANSWER).removeprefix("params.")  # the engine's field names -> the request's
        return self._error(status, message, param.removeprefix("params.") if param else None, code)

    async def on_invalid_body(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            return self._error(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
        param = ".".join(str(p) for p in first["loc"][1:]) or None
        message = first["msg"].removeprefix("Value error, ")
        return self._error(400, f"{param}: {message}" if param else message, param, first["type"])

    async def on_http_error(self, request: Request, exc: HTTPException) -> JSONResponse:
        return self._error(exc.status_code, str(exc.detail))

    def _error(self, status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
        headers = {"Retry-After": str(self.settings.retry_after_s)} if status in (429, 503) else None
        return JSONResponse(error_body(message, _KINDS.get(status, "invalid_request_error"), param, code),
                            status_code=status, headers=headers)


def _engine_images(images: list[ReadImage]) -> dict:
    """An engine call's images argument: none without images (every engine takes that call)."""
    return {"images": [read.image for read in images]} if images else {}


async def serve_openai(settings: OpenAISettings, engine: RolloutEngine, tokenizer, model_name: str,
                       submit: Submit | None = None, images: ImageReader | None = None) -> OpenAIServer:
    """Start serving the endpoint in this asyncio loop; returns once it listens (raises if it cannot bind)."""
    server = await start_http(create_app(engine, tokenizer, model_name, settings, submit, images), settings.host,
                              settings.port, settings.grace_s)
    log.info("OpenAI-compatible endpoint on http://%s:%d/v1", settings.host, server.port)
    return server
