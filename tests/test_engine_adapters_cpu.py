"""The vLLM and SGLang adapters' own logic where it does not need their engines: SGLang cannot run on a CPU, so
its adapter is driven here over a stand-in for `sglang.Engine` whose aborts never land (the adapter code is real;
only the external engine is replaced)."""

import asyncio
import time

import pytest

from rollout.engine.errors import SessionNotFound
from rollout.engine.model_info import ModelInfo
from rollout.engine.sequence import FinishReason
from rollout.engine.sessions import SessionTable
from rollout.engines.settings import SglangSettings
from rollout.engines.sglang_engine import SglangEngine, _Turn


class _DeafTokenizerManager:
    """SGLang's tokenizer manager as a busy engine shows it: aborts are taken and never land."""

    def __init__(self):
        self.aborts: list[str] = []

    def abort_request(self, rid: str) -> None:
        self.aborts.append(rid)


class _DeafSglang:
    def __init__(self):
        self.tokenizer_manager = _DeafTokenizerManager()


def _adapter(abort_timeout_s: float) -> SglangEngine:
    engine = SglangEngine.__new__(SglangEngine)  # everything __init__ sets but sglang.Engine itself
    engine.settings = SglangSettings(type="sglang", abort_timeout_s=abort_timeout_s)
    engine.sgl = _DeafSglang()
    engine.info = ModelInfo("sglang", 64, 128, (0,), "tempered", 600.0)
    engine.weight_version = 3
    engine.sessions = SessionTable(None, 128, 4, 600.0)
    engine._running = {}
    return engine


async def test_sglang_close_session_is_bounded_by_its_deadline_when_the_abort_never_lands():
    engine = _adapter(abort_timeout_s=0.3)
    await engine.open_session("s", [1, 2, 3])
    session = engine.sessions.idle("s")
    turn = _Turn("session/s/x", session.token_ids)
    engine.sessions.start_turn(session, turn, 1.0)
    engine._running[turn.request_id] = [f"{turn.request_id}/0"]
    turn.token_ids += [7, 8]
    turn.logprobs, turn.weight_versions = [-0.5, -0.25], [3, 3]

    started = time.monotonic()
    record = await asyncio.wait_for(engine.close_session("s"), timeout=5)  # the old loop never returned
    assert time.monotonic() - started < 2
    assert engine.sgl.tokenizer_manager.aborts, "the turn's requests were aborted first"
    assert record.finish_reason == FinishReason.ABORT and record.response_ids == [7, 8]
    assert record.logprobs == [-0.5, -0.25] and record.loss_mask == [1, 1]
    assert "s" not in engine.sessions.sessions and turn.request_id not in engine._running
    with pytest.raises(SessionNotFound):
        engine.sessions.get("s")


def test_sglang_abort_timeout_must_be_positive():
    with pytest.raises(ValueError):
        SglangSettings(type="sglang", abort_timeout_s=0)
