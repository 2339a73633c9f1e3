"""Chat calls mapped onto engine sessions: what the endpoint remembers of each session it drives.

An agent framework resends the whole conversation on every call. The first call with a session key
opens an engine session on the rendered messages; each later call must repeat the messages the
session holds (the earlier ones and the assistant replies this endpoint returned), and only the
messages after them are rendered and appended. The context is never re-tokenized, so the trajectory
is exactly the tokens generation saw and produced.
"""

import time
from dataclasses import dataclass, field


def session_key(headers, by_api_key: bool) -> str | None:
    """The session a call belongs to: its `X-Session-Id` header, else (with `by_api_key`, OpenAISettings'
    session_by_key) its bearer API key; None = a call of no session."""
    key = headers.get("x-session-id")
    if key:
        return key
    if by_api_key:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
    return None


def expected_idle(headers) -> float | None:
    """The `X-Session-Expected-Idle-S` header: how long the agent expects to stay away after this turn (its tool's
    run), in seconds, for the engine's session_policy kv_aware; None when absent. ValueError when not a number >= 0."""
    value = headers.get("x-session-expected-idle-s")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"X-Session-Expected-Idle-S: seconds >= 0, got {value!r}")
    return seconds


class HistoryDiverged(ValueError):
    """A call's messages do not continue the session's conversation (400)."""


@dataclass
class ChatSession:
    session_id: str
    history: list[tuple] | None  # keys (ChatMessage.key) of the messages in the context; None: not opened by chat
    awaiting_reply: bool = True  # the context ends with a generation prompt whose turn has not run
    turn_closed: bool = False  # the last reply ended with eos (else the template's end of turn is still due)
    num_tokens: int = 0  # context tokens accounted for by the prompt, appends and replies returned
    reward: float | None = None  # the episode's reward, as last set
    last_used: float = field(default_factory=time.monotonic)

    def new_messages(self, keys: list[tuple]) -> int | None:
        """Index of the first message to append, or None when the call repeats a turn still owed (a retry).

        Raises HistoryDiverged naming the first message that differs from what the session holds.
        """
        held = self.history or []
        for i, (given, kept) in enumerate(zip(keys, held)):
            if given != kept:
                raise HistoryDiverged(f"the history diverged: messages[{i}] differs from the session's {kept[0]} "
                                      "message; resend the earlier messages and the assistant replies as this "
                                      "endpoint returned them")
        if len(keys) < len(held):
            raise HistoryDiverged(f"the history diverged: the session holds {len(held)} messages, the call sends "
                                  f"{len(keys)}")
        if self.awaiting_reply:
            if len(keys) != len(held):
                raise HistoryDiverged("the history diverged: the session still owes the reply to its last "
                                      "messages; resend them unchanged (a retry) before adding more")
            return None
        if len(keys) == len(held):
            raise HistoryDiverged("the history diverged: no new message after the assistant's last reply")
        return len(held)

    def check_tokens(self, num_tokens: int) -> None:
        """Raise HistoryDiverged when the engine's context holds tokens no returned reply accounts for (a
        turn whose client left before its end)."""
        if num_tokens != self.num_tokens:
            raise HistoryDiverged(f"the history diverged: the session holds {num_tokens} tokens, the replies "
                                  f"returned account for {self.num_tokens} (a turn's client left before its end); "
                                  "close the session")

    def replied(self, keys: list[tuple], reply_key: tuple, reply_tokens: int, turn_closed: bool) -> None:
        self.history = [*keys, reply_key]
        self.awaiting_reply = False
        self.num_tokens += reply_tokens
        self.turn_closed = turn_closed
        self.last_used = time.monotonic()


class SessionBook:
    """Session key -> ChatSession; entries idle longer than the engine's session timeout are forgotten
    (the engine has expired those sessions too)."""

    def __init__(self, idle_timeout_s: float):
        self.idle_timeout_s = idle_timeout_s
        self.sessions: dict[str, ChatSession] = {}

    def get(self, session_id: str) -> ChatSession | None:
        session = self.sessions.get(session_id)
        if session is not None:
            session.last_used = time.monotonic()
        return session

    def add(self, session_id: str, history: list[tuple] | None, num_tokens: int = 0) -> ChatSession:
        self._forget_idle()
        session = self.sessions[session_id] = ChatSession(session_id, history, num_tokens=num_tokens)
        return session

    def pop(self, session_id: str) -> ChatSession | None:
        return self.sessions.pop(session_id, None)

    def _forget_idle(self) -> None:
        cutoff = time.monotonic() - self.idle_timeout_s
        for session_id in [k for k, s in self.sessions.items() if s.last_used < cutoff]:
            del self.sessions[session_id]
