"""The session steps every engine shares (the native engine, vLLM's and SGLang's adapters): opening a session on a
checked context, appending checked observations, the params of a session's next turn, and the SessionSteps mixin
over an engine's SessionTable (rollout/engine/sessions.py)."""

import dataclasses
import time
from collections.abc import Sequence as Seq

from rollout.engine.errors import ContextFull, InvalidRequest
from rollout.engine.sampling_params import SamplingParams, validate_prompt
from rollout.engine.sessions import Session, SessionRecord, SessionState, SessionTable


def open_checked(sessions: SessionTable, info, session_id: str, prompt_ids: Seq[int]) -> int:
    """Open a session on a checked initial context (`info`: the engine's ModelInfo); returns its length. Every
    engine's open_session. Raises InvalidRequest, DuplicateRequest, QueueFull (too many sessions), ContextFull."""
    prompt = [int(t) for t in prompt_ids]
    validate_prompt(prompt, info.vocab_size)
    return len(sessions.open(session_id, prompt).token_ids)


def append_checked(sessions: SessionTable, info, session_id: str, token_ids: Seq[int], weight_version: int,
                   turn_reward: float | None) -> int:
    """Append checked observation tokens (loss mask 0); returns the context length. Every engine's
    append_to_session. Raises SessionNotFound, SessionBusy, InvalidRequest, ContextFull."""
    tokens = [int(t) for t in token_ids]
    if tokens:
        validate_prompt(tokens, info.vocab_size, "token_ids")
    elif turn_reward is None:
        raise InvalidRequest("token_ids", "nothing to append: give tokens, text, messages or a turn_reward")
    return len(sessions.append(session_id, tokens, weight_version, turn_reward).token_ids)


def turn_params(session: Session, params: SamplingParams, info) -> SamplingParams:
    """The params of `session`'s next policy turn: one completion, max_tokens cut to the context left. Raises
    InvalidRequest, ContextFull."""
    if params.n != 1:
        raise InvalidRequest("params.n", f"a session turn generates one completion, got n={params.n}")
    context, limit = len(session.token_ids), info.max_model_len
    if limit - context <= 0:
        raise ContextFull(f"the session's context ({context} tokens) is at the context length {limit}; "
                          "nothing more can be generated")
    params = dataclasses.replace(params, max_tokens=min(params.max_tokens, limit - context))
    params.validate(prompt_len=context, vocab_size=info.vocab_size, max_model_len=limit, max_n=1)
    return params


_EXPIRY_CHECK_S = 1.0  # how often a step engine looks for idle sessions


class SessionSteps:
    """The session methods a step engine (rollout/engine/llm_engine.py's LLMEngine, rollout/engines/vllm_engine.py's VllmCore)
    shares: it has `sessions` (a SessionTable), `info` (rollout.engines.base.ModelInfo), `weight_version`,
    `abort(request_id)` and `_next_expiry_check`."""

    sessions: SessionTable
    weight_version: int
    _next_expiry_check: float

    def open_session(self, session_id: str, prompt_ids: Seq[int]) -> int:
        """Open a session on its initial context; returns its length. Raises InvalidRequest, DuplicateRequest,
        QueueFull (too many sessions), ContextFull."""
        return open_checked(self.sessions, self.info, session_id, prompt_ids)

    def append_to_session(self, session_id: str, token_ids: Seq[int], turn_reward: float | None = None) -> int:
        """Append observation tokens (loss mask 0); returns the context length. Raises SessionNotFound,
        SessionBusy, InvalidRequest, ContextFull."""
        return append_checked(self.sessions, self.info, session_id, token_ids, self.weight_version, turn_reward)

    def _turn(self, session_id: str, params: SamplingParams) -> tuple[Session, SamplingParams]:
        """The idle session whose next policy turn `params` asks for, and the params of that turn (turn_params).
        Raises SessionNotFound, SessionBusy, InvalidRequest, ContextFull."""
        session = self.sessions.idle(session_id)
        return session, turn_params(session, params, self.info)

    def session_turn(self, session_id: str) -> str | None:
        """The request id of the session's running turn, if any."""
        session = self.sessions.sessions.get(session_id)
        return session.turn.request_id if session is not None and session.turn is not None else None

    def session_state(self, session_id: str) -> SessionState:
        return self.sessions.state(session_id, self.weight_version)

    def session_tool(self, session_id: str, tool: str) -> None:
        """The session's last turn called `tool` (the service parsed it): learn and expect its wait by tool."""
        session = self.sessions.sessions.get(session_id)
        if session is not None and session.turn is None:
            self.sessions.policy.tool_called(session, tool)

    def close_session(self, session_id: str) -> SessionRecord:
        """Close the session (aborting a running turn first) and return its episode; frees its blocks."""
        request_id = self.session_turn(session_id)
        if request_id is not None:
            self.abort(request_id)
        return self.sessions.close(session_id)

    def expire_sessions(self) -> list[str]:
        """Close sessions idle past their idle timeout (looked for at most once a second)."""
        now = time.monotonic()
        if now < self._next_expiry_check:
            return []
        self._next_expiry_check = now + _EXPIRY_CHECK_S
        return self.sessions.expire()
