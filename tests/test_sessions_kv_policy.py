"""Sessions scheduled by what they will do next (rollout/engine/session_policy.py): under pressure kv_aware moves
out the idle session expected back last (lru: the one used least recently), pins those back soon for a bounded time,
learns waits it is not told; session_admission kv queues new sessions while the working set does not fit, each for
at most its wait bound."""

import asyncio
import time

import pytest

from rollout.config import EngineConfig
from rollout.engine.async_engine import AsyncEngine
from rollout.engine.errors import NotAdmitted, QueueFull
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.session_policy import SessionPolicy
from rollout.engine.sessions import Session

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def make_engine(model_dir, **settings) -> LLMEngine:
    settings = {"block_size": 8, "num_blocks": 12, "max_model_len": 96, **settings}
    return LLMEngine(EngineConfig(model=str(model_dir), **settings))


def turn(engine: LLMEngine, session_id: str, request_id: str, expected_idle_s: float | None = None) -> None:
    engine.add_session_request(request_id, session_id, GREEDY, expected_idle_s)
    while request_id in engine.requests:
        engine.step()


def prompt(seed: int) -> list[int]:
    return [1] + [20 + (seed * 7 + i * 3) % 70 for i in range(30)]


@pytest.mark.parametrize(("policy", "moved_out"), [("lru", "soon"), ("kv_aware", "late")])
def test_under_pressure_the_policy_picks_whose_kv_leaves(tiny_model_dir, policy, moved_out):
    # 12 blocks of 8: two idle sessions of 39 tokens (5 blocks each) leave no room for a third one's turn.
    engine = make_engine(tiny_model_dir, session_policy=policy)
    engine.open_session("soon", prompt(1))
    turn(engine, "soon", "s0", expected_idle_s=1.0)  # used first, back in a second
    engine.open_session("late", prompt(2))
    turn(engine, "late", "l0", expected_idle_s=600.0)  # used last, back in ten minutes
    engine.open_session("new", prompt(3))
    turn(engine, "new", "n0")
    held = {name: bool(engine.sessions.sessions[name].block_table) for name in ("soon", "late")}
    assert held == {"soon": moved_out != "soon", "late": moved_out != "late"}


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def idle(policy: SessionPolicy, name: str, last_used: float, expected_idle_s: float | None) -> Session:
    session = Session(name, [1], 1, last_used)
    policy.turn_ended(session, expected_idle_s)
    return session


def test_a_pin_lasts_at_most_its_ttl_and_unknown_waits_are_learned():
    clock = Clock()
    policy = SessionPolicy("kv_aware", pin_ttl_s=10.0, clock=clock)
    soon = idle(policy, "soon", clock.now, 5.0)
    later = idle(policy, "later", clock.now, 60.0)
    much_later = idle(policy, "much_later", clock.now, 120.0)
    assert policy.victim([soon, later, much_later]) is much_later
    assert policy.victim([soon, later]) is later
    assert policy.victim([soon]) is soon  # pinned, but the only one left
    # A session whose 2 s tool has run 20 s (overdue, its pin expired) goes before one pinned now, though the
    # pinned one is expected back later.
    clock.now -= 20.0
    overdue = idle(policy, "overdue", clock.now, 2.0)
    clock.now += 20.0
    assert overdue.expected_back < soon.expected_back and policy.victim([soon, overdue]) is overdue
    clock.now += 30.0  # soon's pin ran out (TTL 10 s after its turn): plain order by expected return again
    assert policy.victim([soon, overdue]) is soon
    # Learned: a session that came back after 3 s and 3 s again is expected back in about 3 s next time.
    learner = Session("learner", [1], 1, clock.now)
    for _ in range(2):
        policy.turn_ended(learner, None)
        clock.now += 3.0
        policy.turn_started(learner)
    policy.turn_ended(learner, None)
    assert learner.expected_back == pytest.approx(clock.now + 3.0)
    stranger = Session("stranger", [1], 1, clock.now)  # no history of its own: every session's mean so far
    policy.turn_ended(stranger, None)
    assert stranger.expected_back == pytest.approx(clock.now + policy.mean_idle_s)
    # Per tool: a search that took 40 s teaches the policy; a later turn that called it is expected back in 40 s.
    learner.expected_back = None
    policy.tool_called(learner, "search")
    clock.now += 40.0
    policy.turn_started(learner)
    assert policy.tool_idle_s == {"search": pytest.approx(40.0)}
    policy.turn_ended(stranger, None)
    policy.tool_called(stranger, "search")
    assert stranger.expected_back == pytest.approx(clock.now + 40.0)
    policy.turn_ended(stranger, 2.0)  # what the caller says wins over what was learned
    policy.tool_called(stranger, "search")
    assert stranger.expected_back == pytest.approx(clock.now + 2.0)


def test_admission_queues_while_the_working_set_does_not_fit_and_bounds_the_wait(tiny_model_dir):
    engine = make_engine(tiny_model_dir, session_admission="kv", session_admission_wait_s=0.6)

    async def scenario() -> tuple[float, float]:
        served = AsyncEngine(engine)
        try:
            await served.open_session("a", [1] * 60)  # 8 of the 12 blocks
            started = time.monotonic()
            waiting = asyncio.create_task(served.open_session("b", [2] * 40))  # 5 more: 13 > 12
            await asyncio.sleep(0.15)
            assert not waiting.done() and engine.stats["sessions_queued"] == 1
            await served.close_session("a")  # room: b is admitted, having queued
            await waiting
            freed_after = time.monotonic() - started
            started = time.monotonic()
            await served.open_session("c", [3] * 60)  # 5 + 8 > 12 and nobody leaves: admitted at its bound
            return freed_after, time.monotonic() - started
        finally:
            served.shutdown()

    freed_after, bounded_after = asyncio.run(scenario())
    stats = engine.stats
    assert 0.15 <= freed_after < 0.5
    assert 0.6 <= bounded_after < 1.5
    assert stats["sessions_queued_total"] == 2 and stats["sessions_admitted_late"] == 1
    assert stats["sessions_queued"] == 0 and 0.6 <= stats["session_admission_max_wait_s"] < 1.5
    with pytest.raises(NotAdmitted):  # the engine itself refuses; AsyncEngine queues
        engine.open_session("d", [4] * 60)
    assert issubclass(NotAdmitted, QueueFull)  # over the wire: RESOURCE_EXHAUSTED, retried by the runner


def test_the_openai_header_says_how_long_the_agent_stays_away():
    from rollout.serve.openai_sessions import expected_idle

    assert expected_idle({"x-session-expected-idle-s": "2.5"}) == 2.5 and expected_idle({}) is None
    for bad in ("soon", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="X-Session-Expected-Idle-S"):
            expected_idle({"x-session-expected-idle-s": bad})
