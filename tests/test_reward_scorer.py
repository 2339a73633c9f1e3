"""The scorer over real worker processes: timeouts, crashes and errors stay per sample."""

import asyncio
import os
import pathlib
import time
import uuid

import numpy as np
import pytest

from protos.sample import Sample, SampleStatus
from reward.registry import BUILTINS, BadFunction, Registry, RewardSpec
from reward.scorer import Scorer, ScorerSettings, check_timeout

PLUGINS = "tests.test_reward_plugins"  # worker processes import the test functions by this path


# --- fixtures ---

def text_sample(i: int, response: str, status=SampleStatus.COMPLETED, **metadata) -> Sample:
    empty = np.zeros(0)
    return Sample(f"s{i}", "p0", empty.astype("int32"), empty.astype("int32"), empty.astype("uint8"),
                  empty.astype("float32"), empty.astype("int64"), response_text=response, metadata=metadata,
                  status=status, reason="engine error" if status == SampleStatus.FAILED else "")


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def scorer(loop):
    registry = Registry(BUILTINS)
    registry.add(RewardSpec("lengths", f"{PLUGINS}:batch_lengths", batched=True))
    registry.add(RewardSpec("one_result", f"{PLUGINS}:one_result", batched=True))
    registry.add(RewardSpec("scaled", f"{PLUGINS}:length", bound_args={"scale": 2.0}))
    settings = ScorerSettings(max_concurrency=2, model_workers=1, batch_chunk=2, load_timeout_s=60)
    scorer = Scorer(registry, settings, allow_custom=True)
    scorer.start()
    yield scorer
    scorer.close()


def score(loop, scorer, name, samples, args=None, timeout_s=30.0):
    async def run():
        spec = scorer.resolve(name)
        checked = await scorer.check(spec, args or {})
        return await scorer.score(samples, spec, checked, timeout_s)

    return loop.run_until_complete(run())


# --- tests ---

def test_scores_in_order_and_failures_stay_per_sample(loop, scorer):
    samples = [text_sample(0, "42", answer="42"), text_sample(1, "41", answer="42"), text_sample(2, "no answer key"),
               text_sample(3, "42", SampleStatus.FAILED, answer="42")]
    out = score(loop, scorer, "exact_match", samples)
    assert [o.reward for o in out] == [1.0, 0.0, 0.0, 0.0]
    assert [o.status for o in out] == [SampleStatus.COMPLETED, SampleStatus.COMPLETED, SampleStatus.FAILED,
                                       SampleStatus.FAILED]
    assert out[0].details == {"correct": 1.0} and out[0].reason == "extracted '42'"
    assert "metadata['answer'] is missing" in out[2].reason
    assert out[3].reason == "not scored: generation failed (engine error)"


def test_custom_functions_by_path_and_bound_arguments(loop, scorer):
    assert [o.reward for o in score(loop, scorer, f"{PLUGINS}:length", [text_sample(0, "abc")], {"scale": 0.5})] == [1.5]
    assert [o.reward for o in score(loop, scorer, "scaled", [text_sample(0, "abc")])] == [6.0]
    with pytest.raises(BadFunction, match="fixed by the server"):
        score(loop, scorer, "scaled", [], {"scale": 1.0})
    with pytest.raises(BadFunction, match="unexpected keyword argument 'nope'"):
        score(loop, scorer, "exact_match", [], {"nope": 1})
    with pytest.raises(BadFunction, match="cannot import"):
        score(loop, scorer, "tests.no_such_module:fn", [])


def test_a_hung_function_times_out_and_its_worker_is_replaced(loop, scorer):
    replaced = scorer.sample_pool.replaced
    start = time.monotonic()
    out = score(loop, scorer, f"{PLUGINS}:hang", [text_sample(0, "x")], timeout_s=1.0)
    assert time.monotonic() - start < 15
    assert (out[0].status, out[0].reason) == (SampleStatus.FAILED, "timeout after 1s")
    assert scorer.sample_pool.replaced == replaced + 1
    assert score(loop, scorer, "exact_match", [text_sample(0, "7", answer=7)])[0].reward == 1.0


def test_a_crash_or_an_exception_fails_only_that_sample(loop, scorer):
    crashed = score(loop, scorer, f"{PLUGINS}:crash", [text_sample(0, "x")])
    assert crashed[0].status == SampleStatus.FAILED and crashed[0].reason.startswith("reward worker died")
    raised = score(loop, scorer, f"{PLUGINS}:explode", [text_sample(0, "x")])
    assert (raised[0].status, raised[0].reason) == (SampleStatus.FAILED, "RuntimeError: boom")
    assert score(loop, scorer, "exact_match", [text_sample(0, "7", answer=7)])[0].reward == 1.0


def test_batched_functions_get_chunks_in_order(loop, scorer):
    samples = [text_sample(i, "x" * i) for i in range(5)]
    out = score(loop, scorer, "lengths", samples, {"offset": 0.5})
    assert [o.reward for o in out] == [0.5, 1.5, 2.5, 3.5, 4.5]
    wrong = score(loop, scorer, "one_result", samples[:2])
    assert all(o.status == SampleStatus.FAILED and "returned 1 results for 2 samples" in o.reason for o in wrong)


def test_concurrency_is_bounded_by_the_workers(loop, scorer):
    score(loop, scorer, f"{PLUGINS}:nap", [text_sample(0, "")], {"seconds": 0.0})  # both workers import it first
    score(loop, scorer, f"{PLUGINS}:nap", [text_sample(0, ""), text_sample(1, "")], {"seconds": 0.0})
    start = time.monotonic()
    out = score(loop, scorer, f"{PLUGINS}:nap", [text_sample(i, "") for i in range(4)], {"seconds": 0.4})
    assert [o.reward for o in out] == [1.0] * 4
    assert time.monotonic() - start >= 0.8  # 4 naps on 2 workers: two rounds at least


def processes_with(marker: str) -> list[int]:
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_timed_out_sandbox_dies_with_its_worker(loop, scorer):
    marker = f"relayrl-sandboxed-{uuid.uuid4().hex}"

    async def run():
        spec = scorer.resolve(f"{PLUGINS}:sleep_in_sandbox")
        args = await scorer.check(spec, {"marker": marker})
        scoring = asyncio.ensure_future(scorer.score([text_sample(0, "")], spec, args, 5.0))
        deadline = time.monotonic() + 5
        while not processes_with(marker) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        started = bool(processes_with(marker))
        return started, await scoring

    started, out = loop.run_until_complete(run())
    assert started, "the sandboxed program never started"
    assert (out[0].status, out[0].reason) == (SampleStatus.FAILED, "timeout after 5s")
    deadline = time.monotonic() + 5
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = processes_with(marker)
    for pid in survivors:
        os.kill(pid, 9)
    assert not survivors


def test_a_replacement_worker_is_prepared_before_it_takes_samples(loop):
    registry = Registry(BUILTINS)
    registry.add(RewardSpec("prepared", f"{PLUGINS}:needs_preparation", prepare=f"{PLUGINS}:prepare_slowly"))
    scorer = Scorer(registry, ScorerSettings(max_concurrency=1, model_workers=1, load_timeout_s=60))
    scorer.start()
    try:
        # One worker: "hang" times out, its replacement must be warmed up (prepared) before "ok" runs on it,
        # or "ok" pays the 2 s preparation inside its 1 s timeout.
        out = score(loop, scorer, "prepared", [text_sample(0, "hang"), text_sample(1, "ok")], {"key": "k"},
                    timeout_s=1.0)
    finally:
        scorer.close()
    assert (out[0].status, out[0].reason) == (SampleStatus.FAILED, "timeout after 1s")
    assert (out[1].status, out[1].reward) == (SampleStatus.COMPLETED, 1.0), out[1].reason
    assert scorer.sample_pool.replaced == 1


def test_safe_builtins_score_inline_and_long_responses_go_to_workers(loop, scorer):
    samples = [text_sample(0, " 42. ", answer="42"), text_sample(1, "41", answer="42"), text_sample(2, "no key"),
               text_sample(3, "1,234.5", answer=1234.5)]
    unstarted = Scorer(Registry(BUILTINS), ScorerSettings(max_concurrency=1, load_timeout_s=60))  # no workers

    def outcomes(scorer_, name, batch, args=None):
        return [(o.reward, o.status, o.reason) for o in score(loop, scorer_, name, batch, args, timeout_s=10.0)]

    inline = outcomes(unstarted, "exact_match", samples[:3])
    assert inline == outcomes(scorer, "exact_match", samples[:3])
    assert [r for r, _, _ in inline] == [1.0, 0.0, 0.0] and inline[2][1] == SampleStatus.FAILED
    assert "metadata['answer'] is missing" in inline[2][2]
    assert outcomes(unstarted, "numeric_match", samples[3:]) == [(1.0, SampleStatus.COMPLETED, "parsed 1234.5")]
    with pytest.raises(BadFunction, match="unexpected keyword argument 'nope'"):
        score(loop, unstarted, "exact_match", [], {"nope": 1})

    # Over the cap a worker scores it (the started scorer answers; the unstarted one would wait forever).
    capped = Scorer(scorer.registry, ScorerSettings(inline_max_chars=3))
    capped.sample_pool = scorer.sample_pool
    long_text = [text_sample(0, "  42  ", answer="42")]
    assert outcomes(capped, "exact_match", long_text) == outcomes(unstarted, "exact_match", long_text)
    with pytest.raises(asyncio.TimeoutError):
        loop.run_until_complete(asyncio.wait_for(
            Scorer(Registry(BUILTINS), ScorerSettings(inline_max_chars=3)).score(
                long_text, BUILTINS["exact_match"], {}, 10.0), 0.5))


def test_check_timeout():
    assert check_timeout(0, 30, 600) == 30 and check_timeout(2.5, 30, 600) == 2.5
    for bad in (-1, float("nan"), float("inf"), 601):
        with pytest.raises(ValueError, match="timeout_s"):
            check_timeout(bad, 30, 600)
