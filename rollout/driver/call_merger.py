"""Merging the Score / Put calls of concurrent groups into fewer requests."""

import asyncio
from collections.abc import Awaitable, Callable


class CallMerger:
    """Merges the calls that concurrent groups make within `window_s` into one request.

    `send(items)` makes one RPC for a list of items (samples) and returns one result per item;
    each caller gets back the results of its own items, or the call's error. With `window_s` None no
    clock flushes: a request goes out at `max_items` items or when the owner calls `flush()`, so what
    travels together depends on the owner's counts, never on timing (a deterministic run's steps).
    """

    def __init__(self, send: Callable[[list], Awaitable[list]], window_s: float | None, max_items: int) -> None:
        self._send, self._window_s, self._max_items = send, window_s, max_items
        self._waiting: list[tuple[list, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task] = set()

    async def submit(self, items: list) -> list:
        if self._window_s == 0:
            return await self._send(items)
        future = asyncio.get_running_loop().create_future()
        self._waiting.append((items, future))
        if sum(len(waiting) for waiting, _ in self._waiting) >= self._max_items:
            self.flush()
        elif self._timer is None and self._window_s is not None:
            self._timer = asyncio.get_running_loop().call_later(self._window_s, self.flush)
        return await future

    def flush(self) -> None:
        """Send what waits now, as one request (nothing waits: nothing is sent)."""
        if not self._waiting:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        merged, self._waiting = self._waiting, []
        task = asyncio.create_task(self._send_merged(merged))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send_merged(self, merged: list[tuple[list, asyncio.Future]]) -> None:
        try:
            results = await self._send([item for items, _ in merged for item in items])
        except Exception as exc:  # noqa: BLE001 - every caller of this request re-raises it
            for _, future in merged:
                if not future.done():
                    future.set_exception(exc)
            return
        start = 0
        for items, future in merged:
            if not future.done():
                future.set_result(results[start:start + len(items)])
            start += len(items)
