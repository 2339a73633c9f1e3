"""Sessions scheduled by what they will do next: whose KV leaves the cache first, and which new sessions may open.

Between two turns a session waits on its tool. Its caller may say how long (`expected_idle_s` with the turn:
GenerateInSession, or the OpenAI path's session header); otherwise the engine learns it from history: the session's
own earlier waits (a moving average), else the mean wait of every session so far; once the service has read which
tool the turn called (`tool_called`), that tool's mean wait so far, when it has one. `engine.session_policy`:

- `lru` (the default): the idle session used least recently gives up its KV first.
- `kv_aware`: the idle session expected back last gives up its KV first; a session expected back within
  `session_pin_ttl_s` is pinned (its KV leaves only when no unpinned idle session holds any) for at most that long
  after its turn ended, so a tool that overruns its estimate cannot hold the cache.

`engine.session_admission: kv` admits a new session only while the working set (the contexts of the open sessions
and the new one, in blocks) fits in the cache plus the host tier; the others queue (NotAdmitted: AsyncEngine waits
and asks again) and each is admitted anyway once it has waited `session_admission_wait_s`: no session starves.
"""

from collections.abc import Callable, Iterable
from typing import Any

from rollout.engine.errors import NotAdmitted

Session = Any  # rollout/engine/sessions.py's Session (which imports this module)

_EMA = 0.5  # weight of the newest observed wait in a moving average


class SessionPolicy:
    def __init__(self, policy: str, pin_ttl_s: float, clock: Callable[[], float]):
        self.policy = policy
        self.pin_ttl_s = pin_ttl_s
        self.clock = clock
        self.mean_idle_s: float | None = None  # over every session's observed waits
        self.tool_idle_s: dict[str, float] = {}  # tool name -> the mean wait of the turns that called it

    def turn_ended(self, session: Session, expected_idle_s: float | None) -> None:
        """The session went idle now; when it is expected back: as its caller said, else as learned."""
        now = self.clock()
        session.idle_since = now
        session.told = expected_idle_s is not None
        guess = expected_idle_s if expected_idle_s is not None else session.mean_idle_s
        if guess is None:
            guess = self.mean_idle_s
        session.expected_back = None if guess is None else now + guess

    def turn_started(self, session: Session) -> None:
        """The session is back: learn how long it waited."""
        if session.idle_since is None:
            return
        waited = self.clock() - session.idle_since
        session.mean_idle_s = _average(session.mean_idle_s, waited)
        self.mean_idle_s = _average(self.mean_idle_s, waited)
        if session.tool is not None:
            self.tool_idle_s[session.tool] = _average(self.tool_idle_s.get(session.tool), waited)
        session.idle_since = session.expected_back = session.tool = None

    def tool_called(self, session: Session, tool: str) -> None:
        """The session's last turn called `tool`: its wait is learned as that tool's, and expected from that tool's
        history when its caller said nothing."""
        if session.idle_since is None:
            return
        session.tool = tool
        if not session.told and tool in self.tool_idle_s:
            session.expected_back = session.idle_since + self.tool_idle_s[tool]

    def victim(self, holders: Iterable[Session]) -> Session:
        """Of idle sessions holding KV, the one whose KV leaves first."""
        if self.policy == "lru":
            return min(holders, key=lambda s: s.last_used)
        now = self.clock()

        def order(session: Session) -> tuple[bool, float]:
            back = session.expected_back if session.expected_back is not None else session.last_used
            pinned = (session.expected_back is not None and back - now <= self.pin_ttl_s
                      and session.idle_since is not None and now - session.idle_since <= self.pin_ttl_s)
            return (not pinned, back)

        return max(holders, key=order)


    def tier_drop_first(self, sessions: dict[str, Session]) -> Callable[[list[str]], str] | None:
        """What the host tier drops first when full (HostKVTier.put): lru its oldest entry (None); kv_aware the
        session expected back last among its entries and the newcomer (then the newcomer is not kept), never one whose
        turn waits to start while another can go."""
        if self.policy == "lru":
            return None

        def drop_first(ids: list[str]) -> str:
            candidates = [sessions[i] for i in ids]
            return self.victim([s for s in candidates if s.turn is None] or candidates).session_id

        return drop_first


class Admission:
    """engine.session_admission: 'none' admits every session (max_sessions aside); 'kv' queues those that do not fit."""

    def __init__(self, mode: str, wait_s: float, clock: Callable[[], float]):
        self.mode = mode
        self.wait_s = wait_s
        self.clock = clock
        self.waiting: dict[str, float] = {}  # session id -> when it first asked
        self.num_queued = 0  # sessions that waited to be admitted, so far
        self.num_admitted_late = 0  # of them, admitted at their wait bound though the working set did not fit
        self.total_wait_s = 0.0
        self.max_wait_s = 0.0

    def admit(self, session_id: str, fits: Callable[[], bool]) -> None:
        """Return when the session may open now; NotAdmitted while it must wait."""
        if self.mode == "none":
            return
        now = self.clock()
        first = self.waiting.get(session_id)
        fit = fits()
        if not fit and (first is None or now - first < self.wait_s):
            if first is None:
                self.waiting[session_id] = now
                self.num_queued += 1
            raise NotAdmitted(f"session {session_id!r}: the sessions' KV working set does not fit the cache now; "
                              f"queued {now - (first or now):.1f} s of at most {self.wait_s:g} s")
        if first is not None:
            del self.waiting[session_id]
            waited = now - first
            self.total_wait_s += waited
            self.max_wait_s = max(self.max_wait_s, waited)
            self.num_admitted_late += not fit

    def forget(self, session_id: str) -> None:
        """The caller stopped waiting."""
        self.waiting.pop(session_id, None)

    @property
    def stats(self) -> dict[str, int | float]:
        """Sessions queued now and so far, those admitted at their wait bound, and their waits (total and longest)."""
        return {"sessions_queued": len(self.waiting), "sessions_queued_total": self.num_queued,
                "sessions_admitted_late": self.num_admitted_late, "session_admission_wait_s": self.total_wait_s,
                "session_admission_max_wait_s": self.max_wait_s}


def _average(mean: float | None, value: float) -> float:
    return value if mean is None else (1 - _EMA) * mean + _EMA * value
