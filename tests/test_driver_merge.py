"""The driver's CallMerger: concurrent groups' Score/Put calls travel as one request, each gets its own results."""

import asyncio

import pytest

from rollout.driver.call_merger import CallMerger


class Recorder:
    """A stand-in for one RPC: records each request's items and answers item * 10 (or raises)."""

    def __init__(self, fail: bool = False) -> None:
        self.requests: list[list[int]] = []
        self.fail = fail

    async def __call__(self, items: list[int]) -> list[int]:
        self.requests.append(list(items))
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("reward service down")
        return [item * 10 for item in items]


def test_calls_within_the_window_share_one_request_and_get_their_own_results():
    async def run():
        send = Recorder()
        merger = CallMerger(send, window_s=0.05, max_items=100)
        results = await asyncio.gather(merger.submit([1, 2]), merger.submit([3]), merger.submit([4, 5, 6]))
        return send.requests, results

    requests, results = asyncio.run(run())
    assert requests == [[1, 2, 3, 4, 5, 6]]
    assert results == [[10, 20], [30], [40, 50, 60]]


def test_a_full_request_leaves_at_once_and_a_zero_window_never_merges():
    async def run():
        send = Recorder()
        merger = CallMerger(send, window_s=30.0, max_items=4)  # the window would outlast the test
        first = await asyncio.wait_for(asyncio.gather(merger.submit([1, 2]), merger.submit([3, 4])), 5)
        direct = CallMerger(send, window_s=0, max_items=4)
        second = await asyncio.gather(direct.submit([5]), direct.submit([6]))
        return send.requests, first, second

    requests, first, second = asyncio.run(run())
    assert requests == [[1, 2, 3, 4], [5], [6]]
    assert first == [[10, 20], [30, 40]] and second == [[50], [60]]


def test_a_failed_request_fails_every_caller_in_it():
    async def run():
        merger = CallMerger(Recorder(fail=True), window_s=0.01, max_items=100)
        return await asyncio.gather(merger.submit([1]), merger.submit([2]), return_exceptions=True)

    outcomes = asyncio.run(run())
    assert [type(o) for o in outcomes] == [RuntimeError, RuntimeError]
    with pytest.raises(RuntimeError, match="reward service down"):
        raise outcomes[0]
