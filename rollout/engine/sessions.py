"""Multi-turn sessions: one growing context per agent episode, its KV kept between turns.

A session holds the exact token ids generation saw and produced (token in, token out): its initial
tokens, then policy turns (loss mask 1, each token with its logprob and weight version) and
observation tokens (loss mask 0). Between turns the session owns the KV blocks of its context, so the
next turn prefills only the tokens added since. When the cache runs short the blocks of the idle
session used least recently are dropped (`evict_idle`); its next turn recomputes them from its tokens. A weight
update with kv_on_update recompute drops every idle session's blocks so (`drop_kv`); with keep, the next turn
reuses them, and its kv_version says how old they are (rollout/engine/sequence.py).

The table is engine state: only the engine thread touches it (see LLMEngine).
"""

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from rollout.engine.block_manager import BlockManager
from rollout.engine.errors import (
    ContextFull,
    DuplicateRequest,
    InvalidRequest,
    QueueFull,
    SessionBusy,
    SessionNotFound,
)
from rollout.engine.multimodal import ImageInput, MultimodalPrompt
from rollout.engine.sampling_params import SamplingParams, validate_prompt
from rollout.engine.sequence import FinishReason, Sequence, oldest

_EXPIRED_IDS_KEPT = 10_000  # ids remembered after expiry, so a late call hears "expired", not "unknown"


@dataclass
class Session:
    session_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    last_used: float
    loss_mask: list[int] = field(default_factory=list)  # per token after the prompt, as are the next two
    logprobs: list[float] = field(default_factory=list)  # 0 for observation tokens
    weight_versions: list[int] = field(default_factory=list)  # observation tokens: the version when appended
    turn_rewards: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # between turns: the blocks of the cached tokens
    num_cached_tokens: int = 0
    turn: Sequence | None = None  # the policy turn running now
    finish_reason: FinishReason | None = None  # of the last turn
    temperature: float | None = None  # the logprobs' temperature, fixed by the first turn
    turns: int = 0
    prefill_tokens: int = 0
    turn_prefill_tokens: list[int] = field(default_factory=list)
    kv_recomputes: int = 0
    context_version: int | None = None  # of the KV the last turn left (Sequence.context_version)
    stale_kv_version: int | None = None  # the oldest of its turns' (Sequence.stale_kv_version)
    multimodal: MultimodalPrompt | None = None  # its images and M-RoPE positions (rollout/engine/multimodal.py)


@dataclass(frozen=True)
class SessionState:
    num_tokens: int
    finish_reason: FinishReason | None  # of the last policy turn; None before the first
    busy: bool  # a turn is running
    weight_version: int


@dataclass(frozen=True)
class SessionRecord:
    """A closed session: the episode as one trajectory, and what it cost the engine."""

    session_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    turn_rewards: list[float]
    finish_reason: FinishReason | None
    temperature: float  # 0: no policy turn was generated
    turns: int
    prefill_tokens: int
    turn_prefill_tokens: list[int]
    kv_recomputes: int
    # Sequence.kv_version over the episode: a token of weight version w was sampled on KV computed with versions
    # in [min(w, kv_version), w]. None: no KV was computed (no policy turn, or an engine that does not say: vLLM,
    # SGLang).
    kv_version: int | None = None
    images: list[ImageInput] = field(default_factory=list)  # the context's images, in order (a vision-language model)


class SessionTable:
    """The open sessions. `block_manager` holds their KV between turns (the native engine); None for an engine
    whose own prefix cache keeps a context's KV (vLLM, SGLang: a turn sends the whole context)."""

    def __init__(self, block_manager: BlockManager | None, max_model_len: int, max_sessions: int, idle_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self.num_expired = 0
        self.num_evictions = 0

    def open(self, session_id: str, prompt_ids: list[int]) -> Session:
        if session_id in self.sessions:
            raise DuplicateRequest(f"session_id: {session_id!r} is already open")
        if len(self.sessions) >= self.max_sessions:
            raise QueueFull(f"{len(self.sessions)} sessions are open (max_sessions={self.max_sessions}); close one "
                            "or retry later")
        if len(prompt_ids) >= self.max_model_len:
            raise ContextFull(f"the initial context ({len(prompt_ids)} tokens) leaves no room to generate within "
                              f"the context length {self.max_model_len}")
        self._expired.pop(session_id, None)
        session = Session(session_id, list(prompt_ids), len(prompt_ids), self.clock())
        self.sessions[session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self._expired:
                raise SessionNotFound(f"session {session_id!r} expired after {self.idle_timeout_s:g} s idle")
            raise SessionNotFound(f"session {session_id!r} is not open (never opened, or closed)")
        session.last_used = self.clock()
        return session

    def idle(self, session_id: str) -> Session:
        """The session, which must not be running a turn."""
        session = self.get(session_id)
        if session.turn is not None:
            raise SessionBusy(f"session {session_id!r} is generating a turn; wait for it to finish")
        return session

    def append(self, session_id: str, token_ids: list[int], weight_version: int, turn_reward: float | None) -> Session:
        session = self.idle(session_id)
        if len(session.token_ids) + len(token_ids) > self.max_model_len:
            raise ContextFull(f"appending {len(token_ids)} tokens to {len(session.token_ids)} exceeds the context "
                              f"length {self.max_model_len}")
        session.token_ids += token_ids
        session.loss_mask += [0] * len(token_ids)
        session.logprobs += [0.0] * len(token_ids)
        session.weight_versions += [weight_version] * len(token_ids)
        if turn_reward is not None:
            session.turn_rewards.append(float(turn_reward))
        return session

    def start_turn(self, session: Session, seq: Sequence, temperature: float) -> None:
        """Hand the session's context and cached blocks to `seq`, the turn about to be scheduled."""
        if session.temperature is not None and temperature != session.temperature:
            raise InvalidRequest("params.temperature", f"the session's logprobs are at temperature "
                                 f"{session.temperature:g}; every turn must use it (got {temperature:g})")
        if session.turns and session.num_cached_tokens == 0:
            session.kv_recomputes += 1
        session.temperature = temperature
        seq.session = session
        seq.block_table, session.block_table = session.block_table, []
        seq.num_cached_tokens = session.num_cached_tokens
        seq.context_version = session.context_version if session.num_cached_tokens else None
        session.turn = seq
        session.turn_prefill_tokens.append(0)

    def end_turn(self, seq: Sequence) -> None:
        """Take a finished (or aborted) turn's tokens and blocks back into its session."""
        session = seq.session
        outputs = seq.num_output_tokens
        session.token_ids = seq.token_ids
        session.loss_mask += [1] * outputs
        session.logprobs += seq.logprobs
        session.weight_versions += seq.weight_versions
        session.block_table, seq.block_table = seq.block_table, []
        session.num_cached_tokens = min(seq.num_cached_tokens, len(session.token_ids))
        if seq.context_version is not None:  # (a turn aborted before it computed any KV leaves the last one)
            session.context_version = seq.context_version
        session.stale_kv_version = oldest(session.stale_kv_version, seq.stale_kv_version)
        session.finish_reason = seq.finish_reason
        session.turn = None
        session.turns += 1
        session.last_used = self.clock()
        seq.session = None

    def close(self, session_id: str) -> SessionRecord:
        session = self.idle(session_id)
        del self.sessions[session_id]
        self._free(session)
        start = session.num_prompt_tokens
        return SessionRecord(
            session_id=session_id, prompt_ids=session.token_ids[:start], response_ids=session.token_ids[start:],
            loss_mask=session.loss_mask, logprobs=session.logprobs, weight_versions=session.weight_versions,
            turn_rewards=session.turn_rewards, finish_reason=session.finish_reason,
            temperature=session.temperature or 0.0, turns=session.turns, prefill_tokens=session.prefill_tokens,
            turn_prefill_tokens=session.turn_prefill_tokens, kv_recomputes=session.kv_recomputes,
            kv_version=oldest(session.context_version, session.stale_kv_version),
            images=list(session.multimodal.images) if session.multimodal is not None else [],
        )

    def state(self, session_id: str, weight_version: int) -> SessionState:
        session = self.get(session_id)
        return SessionState(len(session.token_ids), session.finish_reason, session.turn is not None, weight_version)

    def evict_idle(self) -> bool:
        """Drop the KV blocks of the least recently used idle session that holds any; whether one did."""
        holders = [s for s in self.sessions.values() if s.turn is None and s.block_table]
        if not holders:
            return False
        self._free(min(holders, key=lambda s: s.last_used))
        self.num_evictions += 1
        return True

    def drop_kv(self) -> None:
        """Drop every idle session's KV (new weights, kv_on_update recompute): each recomputes its context with the
        weights of its next turn. A running turn's KV is the scheduler's to drop."""
        for session in self.sessions.values():
            if session.turn is None:
                self._free(session)

    def expire(self) -> list[str]:
        """Close the sessions idle for longer than idle_timeout_s (not those running a turn); their ids."""
        cutoff = self.clock() - self.idle_timeout_s
        gone = [s.session_id for s in self.sessions.values() if s.turn is None and s.last_used < cutoff]
        for session_id in gone:
            self._free(self.sessions.pop(session_id))
            self._expired[session_id] = None
            if len(self._expired) > _EXPIRED_IDS_KEPT:
                self._expired.popitem(last=False)
        self.num_expired += len(gone)
        return gone

    @property
    def num_blocks_held(self) -> int:
        return sum(len(s.block_table) for s in list(self.sessions.values()))  # read by the metrics thread too

    def _free(self, session: Session) -> None:
        if self.block_manager is not None:
            self.block_manager.release(session.block_table)
        session.block_table = []
        session.num_cached_tokens = 0


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
