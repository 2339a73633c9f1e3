"""When an appended record counts as durable: the fsync policy, with group commit.

- `batch`: group commit. A call registers the log position it needs durable; the flusher waits
  `window_s` after the first such call, fsyncs once, and releases every call whose bytes that
  fsync covered. Concurrent Puts and Acks share one fsync.
- `always`: the same flusher without the window: an fsync starts as soon as a call waits (calls
  that arrive while one runs share the next).
- `never`: durable once written to the OS: survives a killed buffer, not a machine crash.

The fsync runs in a worker thread, so the event loop keeps serving while the disk works.
"""

import asyncio
import enum
import heapq
import itertools
import os
import time
from collections.abc import Callable

from services.buffer.log import SegmentLog


class FsyncPolicy(str, enum.Enum):
    ALWAYS = "always"
    BATCH = "batch"
    NEVER = "never"


def _fsync_and_close(fd: int) -> None:
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


class Durability:
    """Hands out futures that complete once a log position is durable under the policy."""

    def __init__(
        self,
        log: SegmentLog,
        policy: FsyncPolicy,
        window_s: float = 0.002,
        on_fsync: Callable[[float], None] | None = None,
    ):
        self.log = log
        self.policy = FsyncPolicy(policy)
        self.window_s = window_s if self.policy is FsyncPolicy.BATCH else 0.0
        self.on_fsync = on_fsync
        self.durable = log.appended  # everything before this position is durable
        self.fsyncs = 0
        self.failure: OSError | None = None
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # heap by position
        self._tiebreak = itertools.count()
        self._wake = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.policy is not FsyncPolicy.NEVER and self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop(), name="buffer-fsync")

    def durable_future(self, position: int) -> asyncio.Future[None]:
        """A future that completes once the log up to `position` is durable (or fails with the
        OSError of a failed fsync)."""
        future = asyncio.get_running_loop().create_future()
        if self.failure is not None:
            future.set_exception(self.failure)
        elif self.policy is FsyncPolicy.NEVER or position <= self.durable:
            future.set_result(None)
        elif self._flusher is None:
            raise RuntimeError("Durability.start() was not called")
        else:
            heapq.heappush(self._waiters, (position, next(self._tiebreak), future))
            self._wake.set()
        return future

    async def wait(self, position: int) -> None:
        await self.durable_future(position)

    async def _flush_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)
            await self._sync()

    async def _sync(self) -> None:
        fd, target = self.log.sync_target()
        start = time.perf_counter()
        try:
            await asyncio.to_thread(_fsync_and_close, fd)
        except OSError as exc:
            # After a failed fsync the kernel may have dropped the dirty pages: nothing written
            # since the last good fsync can be called durable again. Every later wait fails.
            self.failure = exc
        if self.failure is not None:
            failure = self.failure
            self._release(lambda future: future.set_exception(failure), until=None)
            return
        self.fsyncs += 1
        if self.on_fsync is not None:
            self.on_fsync(time.perf_counter() - start)
        self.durable = max(self.durable, target)
        self._release(lambda future: future.set_result(None), until=target)

    def _release(self, settle: Callable[[asyncio.Future[None]], None], until: int | None) -> None:
        while self._waiters and (until is None or self._waiters[0][0] <= until):
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():  # a waiting call may have been cancelled
                settle(future)

    async def close(self) -> None:
        """Stop the flusher after a last fsync of everything appended."""
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
            self._flusher = None
        if self.log.appended > self.durable and self.failure is None:
            await self._sync()
