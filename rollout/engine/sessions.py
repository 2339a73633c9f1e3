"""Multi-turn sessions: one growing context per agent episode, its KV kept between turns.

A session holds the exact token ids generation saw and produced (token in, token out): its initial
tokens, then policy turns (loss mask 1, each token with its logprob and weight version) and
observation tokens (loss mask 0). Between turns the session owns the KV blocks of its context, so the
next turn prefills only the tokens added since. When the cache runs short the blocks of an idle session are
dropped (`evict_idle`: which one, engine.session_policy, rollout/engine/session_policy.py); with a host tier
(rollout/kv/host_tier.py) their KV is copied there first and copied back at the session's next turn (`restore`),
else that turn recomputes it from its tokens. A weight update with kv_on_update recompute drops every idle session's
KV so, the tier's too (`drop_kv`); with keep, the next turn reuses it, and its kv_version says how old it is
(rollout/engine/sequence.py).

The table is engine state: only the engine thread touches it (see LLMEngine).
"""

import time
from collections import OrderedDict
from collections.abc import Callable
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
from rollout.engine.sequence import FinishReason, Sequence, oldest
from rollout.engine.session_policy import Admission, SessionPolicy
from rollout.kv.host_tier import HostKVTier

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
    routes: object = None  # of a mixture-of-experts model: its context's routes, kept with its KV (Sequence.routes)
    next_idle_s: float | None = None  # the running turn's caller: how long its tool will take after the turn
    idle_since: float | None = None  # when its last turn ended (None while it has not ended one since it was back)
    expected_back: float | None = None  # when its next turn is expected (SessionPolicy)
    mean_idle_s: float | None = None  # its waits between turns so far (a moving average)
    told: bool = False  # its caller said expected_idle_s for the last turn
    tool: str | None = None  # the tool its last turn called, when the service read it (SessionPolicy.tool_called)
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
    # Of a mixture-of-experts model: the experts each token of prompt + response but the last was routed to, as its
    # KV was computed (np.ndarray [tokens, layers, top_k]); None: not recorded
    routed_experts: object = None
    images: list[ImageInput] = field(default_factory=list)  # the context's images, in order (a vision-language model)


class SessionTable:
    """The open sessions. `block_manager` holds their KV between turns (the native engine); None for an engine
    whose own prefix cache keeps a context's KV (vLLM, SGLang: a turn sends the whole context)."""

    def __init__(self, block_manager: BlockManager | None, max_model_len: int, max_sessions: int, idle_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, tier: HostKVTier | None = None, policy: str = "lru",
                 pin_ttl_s: float = 30.0, admission: str = "none", admission_wait_s: float = 30.0):
        self.block_manager = block_manager
        self.tier = tier  # the host tier idle sessions' KV goes to; None: dropped, recomputed
        self.policy = SessionPolicy(policy, pin_ttl_s, clock)
        self.admission = Admission(admission, admission_wait_s, clock)
        self.max_model_len = max_model_len
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self.sessions: dict[str, Session] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self.num_expired = 0
        self.num_evictions = 0
        self.num_tier_misses = 0  # sessions back whose tiered KV found no free blocks (recomputed)

    def open(self, session_id: str, prompt_ids: list[int]) -> Session:
        if session_id in self.sessions:
            raise DuplicateRequest(f"session_id: {session_id!r} is already open")
        if len(self.sessions) >= self.max_sessions:
            raise QueueFull(f"{len(self.sessions)} sessions are open (max_sessions={self.max_sessions}); close one "
                            "or retry later")
        if len(prompt_ids) >= self.max_model_len:
            raise ContextFull(f"the initial context ({len(prompt_ids)} tokens) leaves no room to generate within "
                              f"the context length {self.max_model_len}")
        self.admission.admit(session_id, lambda: self._fits(len(prompt_ids)))
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
        tiered = self.tier is not None and session.session_id in self.tier.entries  # restore() brings it back
        if session.turns and session.num_cached_tokens == 0 and not tiered:
            session.kv_recomputes += 1
        self.policy.turn_started(session)
        session.temperature = temperature
        seq.session = session
        seq.block_table, session.block_table = session.block_table, []
        seq.num_cached_tokens = session.num_cached_tokens
        seq.context_version = session.context_version if session.num_cached_tokens else None
        seq.routes = session.routes
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
        session.routes = seq.routes
        session.finish_reason = seq.finish_reason
        session.turn = None
        session.turns += 1
        session.last_used = self.clock()
        self.policy.turn_ended(session, session.next_idle_s)
        session.next_idle_s = None
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
            routed_experts=session.routes.prefix(len(session.token_ids) - 1) if session.routes is not None else None,
            images=list(session.multimodal.images) if session.multimodal is not None else [],
        )

    def state(self, session_id: str, weight_version: int) -> SessionState:
        session = self.get(session_id)
        return SessionState(len(session.token_ids), session.finish_reason, session.turn is not None, weight_version)

    def evict_idle(self) -> bool:
        """Free the KV blocks of one idle session that holds any, the policy's choice: into the host tier when there is
        one, else dropped. Whether one did."""
        holders = [s for s in self.sessions.values() if s.turn is None and s.block_table]
        if not holders:
            return False
        victim = self.policy.victim(holders)
        if self.tier is not None and victim.num_cached_tokens:
            self.tier.put(victim.session_id, victim.block_table, victim.num_cached_tokens, victim.context_version,
                          self.policy.tier_drop_first(self.sessions))
        self._free(victim, keep_tier=True)
        self.num_evictions += 1
        return True

    def restore(self, seq: Sequence, must: bool) -> None:
        """Bring the KV of a session turn about to start (`seq`, holding no blocks) back from the host tier into fresh
        blocks, moving idle sessions out for room. Without room it stays in the tier (the turn waits for blocks), or
        with `must` (nothing runs that would free blocks) it is given up and the turn recomputes it."""
        session = seq.session
        if self.tier is None or session is None or seq.block_table or session.session_id not in self.tier.entries:
            return
        manager = self.block_manager
        needed = manager.blocks_for(self.tier.entries[session.session_id].num_tokens)
        self.tier.pinned.add(session.session_id)  # the sessions moved out for room must not push it out of the tier
        try:
            while manager.num_free_blocks < needed and self.evict_idle():
                pass
        finally:
            self.tier.pinned.discard(session.session_id)
        if manager.num_free_blocks < needed:
            if must:
                self.tier.discard(session.session_id)
                self.num_tier_misses += 1
                session.kv_recomputes += 1
            return
        entry = self.tier.take(session.session_id)
        seq.block_table = manager.take_private(needed)  # not offered to the prefix cache (maybe lossy or stale)
        self.tier.restore(entry, seq.block_table)
        seq.num_cached_tokens = entry.num_tokens
        seq.context_version = entry.kv_version

    def drop_kv(self) -> None:
        """Drop every idle session's KV (new weights, kv_on_update recompute), in the cache and in the tier: each
        recomputes its context with the weights of its next turn. A running turn's KV is the scheduler's to drop."""
        for session in self.sessions.values():
            if session.turn is None:
                self._free(session)
        if self.tier is not None:
            self.tier.clear()

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

    def _free(self, session: Session, keep_tier: bool = False) -> None:
        if self.block_manager is not None:
            self.block_manager.release(session.block_table)
        if self.tier is not None and not keep_tier:
            self.tier.discard(session.session_id)
        session.block_table = []
        session.num_cached_tokens = 0

    def _fits(self, num_new_tokens: int) -> bool:
        """Whether the contexts of every open session and of a new one of `num_new_tokens` fit in the cache and the
        host tier together (blocks)."""
        manager = self.block_manager
        if manager is None:
            return True
        working = sum(manager.blocks_for(len(s.token_ids)) for s in self.sessions.values())
        room = manager.num_blocks + (self.tier.capacity_blocks if self.tier is not None else 0)
        return working + manager.blocks_for(num_new_tokens) <= room
