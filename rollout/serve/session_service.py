"""The session RPCs of the rollout service: OpenSession, AppendToSession, GenerateInSession, CloseSession.

Proto <-> the engine's sessions (rollout/engine/sessions.py), refusals turned into status codes, and the closed
episode built into a Sample, optionally put into the replay buffer (so an environment in any language
needs only the rollout service).
"""

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
import numpy as np
from prometheus_client import Counter

from protos import buffer_pb2, buffer_pb2_grpc, rollout_pb2
from protos.codec import CodecError, decode_array, encode_array, unpack_metadata
from protos.sample import Sample, SampleImage, SampleStatus
from rollout.engine.errors import (
    ContextFull,
    DuplicateRequest,
    InvalidRequest,
    QueueFull,
    SessionBusy,
    SessionNotFound,
)
from rollout.engine.sequence import FinishReason
from rollout.engine.sessions import SessionRecord
from rollout.serve.chat import NoChatTemplate, render_continuation, render_prompt
from rollout.serve.tool_calls import split_tool_calls
from rollout.serve.wire import TOKENS_GENERATED, generate_chunk

log = logging.getLogger(__name__)

SESSIONS_OPENED = Counter("relayrl_rollout_sessions_opened_total", "Sessions opened")
SESSIONS_CLOSED = Counter("relayrl_rollout_sessions_closed_total", "Sessions closed (episodes returned)")
SESSIONS_SUBMITTED = Counter("relayrl_rollout_sessions_submitted_total", "Closed sessions put into the buffer")

SESSION_CODES = (
    (SessionNotFound, grpc.StatusCode.NOT_FOUND),
    (SessionBusy, grpc.StatusCode.FAILED_PRECONDITION),
    (NoChatTemplate, grpc.StatusCode.FAILED_PRECONDITION),
    (ContextFull, grpc.StatusCode.OUT_OF_RANGE),
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS),
)
_STATUS = {
    FinishReason.STOP: SampleStatus.COMPLETED,
    FinishReason.LENGTH: SampleStatus.TRUNCATED,
    FinishReason.ABORT: SampleStatus.ABORTED,
    None: SampleStatus.ABORTED,  # no policy turn was generated
}
_BUFFER_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)


class SessionRPCs:
    """Mixed into RolloutServicer, which provides engine, tokenizer, decode_text, _params, _with_images (a session
    call's image parts), buffer_channel and buffer_timeout_s."""

    async def OpenSession(self, request: rollout_pb2.OpenSessionRequest, context) -> rollout_pb2.OpenSessionResponse:
        session_id = request.session_id or uuid.uuid4().hex
        prompt = self._context_tokens(request.prompt_ids, request.prompt_text, request.messages, opening=True,
                                      add_bos=request.add_bos)
        prompt, images = self._with_images(prompt, request.images)
        async with _refusals(context):
            num_tokens = await self.engine.open_session(session_id, prompt, **images)
        SESSIONS_OPENED.inc()
        return rollout_pb2.OpenSessionResponse(session_id=session_id, num_tokens=num_tokens,
                                               token_ids=encode_array(prompt, "int32"))

    async def AppendToSession(self, request: rollout_pb2.AppendToSessionRequest, context
                              ) -> rollout_pb2.AppendToSessionResponse:
        async with _refusals(context):
            turn_closed = True
            if request.messages:
                state = await self.engine.session_state(request.session_id)
                turn_closed = state.finish_reason is FinishReason.STOP
            tokens = self._context_tokens(request.token_ids, request.text, request.messages, opening=False,
                                          turn_closed=turn_closed)
            reward = request.turn_reward if request.HasField("turn_reward") else None
            tokens, images = self._with_images(tokens, request.images)
            num_tokens = await self.engine.append_to_session(request.session_id, tokens, reward, **images)
        return rollout_pb2.AppendToSessionResponse(num_tokens=num_tokens, token_ids=encode_array(tokens, "int32"))

    async def GenerateInSession(self, request: rollout_pb2.GenerateInSessionRequest, context
                                ) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        params = self._params(request.params)
        async with _refusals(context):
            if request.HasField("expected_idle_s") and not 0 <= request.expected_idle_s < float("inf"):
                raise InvalidRequest("expected_idle_s", f"seconds >= 0, got {request.expected_idle_s}")
            idle_s = request.expected_idle_s if request.HasField("expected_idle_s") else None
            text = []
            async for delta in self.engine.generate_in_session(request.session_id, params, whole=request.whole_turn,
                                                               expected_idle_s=idle_s):
                TOKENS_GENERATED.inc(len(delta.token_ids))
                text.append(self.decode_text(delta.token_ids))
                yield generate_chunk(request.session_id, delta, request.params.logprobs, text[-1])
            _, calls = split_tool_calls("".join(text))
            if calls:  # the engine learns this tool's waits (engine.session_policy)
                await self.engine.session_tool(request.session_id, calls[0].name)

    async def CloseSession(self, request: rollout_pb2.CloseSessionRequest, context) -> rollout_pb2.CloseSessionResponse:
        metadata = unpack_metadata(request.metadata)  # CodecError (INVALID_ARGUMENT) before the session is gone
        if request.submit and self.buffer_channel is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "submit: this rollout service has no buffer configured (set `buffer: HOST:PORT`)")
        async with _refusals(context):
            record = await self.engine.close_session(request.session_id)
        SESSIONS_CLOSED.inc()
        sample = self._sample(record, request, metadata)
        submitted = await self._submit(sample) if request.submit else False
        return rollout_pb2.CloseSessionResponse(
            sample=sample.to_proto(), submitted=submitted,
            stats=rollout_pb2.SessionStats(turns=record.turns, prefill_tokens=record.prefill_tokens,
                                           turn_prefill_tokens=record.turn_prefill_tokens,
                                           kv_recomputes=record.kv_recomputes))

    def _context_tokens(self, ids, text: str, messages, *, opening: bool, add_bos: bool = False,
                        turn_closed: bool = True) -> list[int]:
        """Tokens from exactly one of ids / text / messages; CodecError (INVALID_ARGUMENT) otherwise."""
        token_ids = decode_array(ids, field="token_ids" if not opening else "prompt_ids", expect="int32").tolist()
        given = [name for name, value in (("ids", token_ids), ("text", text), ("messages", messages)) if value]
        if len(given) > 1:
            raise CodecError(f"give one of token ids, text and messages, not {' and '.join(given)}")
        if messages:
            dicts = [{"role": m.role, "content": m.content,
                      **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {}),
                      **({"name": m.name} if m.name else {})} for m in messages]
            try:
                if opening:
                    return render_prompt(self.tokenizer, dicts)
                return render_continuation(self.tokenizer, dicts, turn_closed=turn_closed)
            except NoChatTemplate:
                raise
            except ValueError as exc:
                raise CodecError(f"messages: {exc}") from exc
        if text:
            tokens = self.tokenizer(text, add_special_tokens=False).input_ids
            if opening and add_bos and self.tokenizer.bos_token_id is not None:
                tokens = [self.tokenizer.bos_token_id, *tokens]
            return tokens
        return token_ids

    def _sample(self, record: SessionRecord, request: rollout_pb2.CloseSessionRequest, metadata: dict) -> Sample:
        mask = np.asarray(record.loss_mask, np.uint8)
        return Sample(
            sample_id=request.sample_id or record.session_id,
            prompt_id=request.prompt_id or record.session_id,
            group_id=request.group_id,
            group_size=request.group_size,
            prompt_ids=np.asarray(record.prompt_ids, np.int32),
            response_ids=np.asarray(record.response_ids, np.int32),
            loss_mask=mask,
            rollout_logprobs=np.asarray(record.logprobs, np.float32),
            weight_versions=np.asarray(record.weight_versions, np.int64),
            reward=request.reward,
            reward_details=dict(request.reward_details),
            turn_rewards=np.asarray(record.turn_rewards, np.float32),
            status=_STATUS[record.finish_reason],
            reason="" if record.finish_reason is not None else "no policy turn was generated",
            prompt_text=self.decode_text(record.prompt_ids),
            response_text=self.decode_text(record.response_ids),
            metadata={**metadata, "session_id": record.session_id, "turns": record.turns},
            temperature=record.temperature,
            kv_version=record.kv_version,
            routed_experts=(record.routed_experts if record.routed_experts is not None
                            else Sample.routed_experts_unset()),
            images=[SampleImage(image.hash, image.media_type, image.grid_thw, image.num_tokens(self.images.merge_size),
                                image.data) for image in record.images],
        )

    async def submit_episode(self, record: SessionRecord, reward: float, group_id: str, group_size: int) -> bool:
        """Put a closed session's episode into the buffer (the OpenAI endpoint's close route); whether it is stored."""
        request = rollout_pb2.CloseSessionRequest(session_id=record.session_id, reward=reward, group_id=group_id,
                                                  group_size=group_size)
        return await self._submit(self._sample(record, request, {}))

    async def _submit(self, sample: Sample) -> bool:
        """Put the episode into the buffer, retrying while it is unavailable or full for up to buffer_timeout_s.
        False when it could not be stored: the caller still gets the sample in the reply."""
        stub = buffer_pb2_grpc.BufferStub(self.buffer_channel)
        request = buffer_pb2.PutRequest(samples=[sample.to_proto()])
        give_up = time.monotonic() + self.buffer_timeout_s
        while True:
            try:
                reply = await stub.Put(request, timeout=max(0.1, give_up - time.monotonic()))
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _BUFFER_RETRYABLE or time.monotonic() >= give_up:
                    log.warning("session %s: the buffer did not store its sample: %s: %s", sample.sample_id,
                                exc.code().name, exc.details())
                    return False
                await asyncio.sleep(0.2)
        SESSIONS_SUBMITTED.inc(reply.accepted)
        return reply.accepted + reply.duplicates == 1


class _refusals:
    """async with: an engine refusal ends the call with its status code (EngineDead: UNAVAILABLE)."""

    def __init__(self, context):
        self.context = context

    async def __aenter__(self):
        return self

    async def __aexit__(self, kind, exc, tb):
        from rollout.engine.errors import EngineDead

        if exc is None:
            return False
        for refusal, code in SESSION_CODES:
            if isinstance(exc, refusal):
                await self.context.abort(code, str(exc))
        if isinstance(exc, EngineDead):
            await self.context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return False
