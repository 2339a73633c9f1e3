"""What the rollout driver and the episode runner share: start groups one at a time, each admitted by
rollout/driver/admission.py, a bounded number in flight, stats written to a JSONL file every 2 s.

A subclass sets `rollout`, `buffer` (stubs) and `stats` (with a "retries" count) and implements
`run_group(item, group_index)` and `snapshot()`. With `position_path` set, where the producer stands in its
stream is kept there (rollout/driver/position.py): a producer started again goes on from it. A sample of its
scored groups goes to the trajectory log (rollout/driver/trajectory_log.py) through `log_group`.
"""

import argparse
import asyncio
import itertools
import json
import logging
import random
import signal
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence

import grpc

from protos import buffer_pb2, rollout_pb2
from rollout.driver.admission import Gauge, Pipeline, admit
from rollout.driver.position import Position
from rollout.driver.trajectory_log import TrajectoryLog, group_record
from services.config import load_config
from services.runtime import Sparse
from services.teardown import skip_final_collection
from services.tracing import setup_tracing, span

log = logging.getLogger("relayrl.producer")
WATCH_S = 5.0  # one GetWeightVersion watch waits at most this long for new weights
STOP_GRACE_S = 3.0  # on SIGTERM/SIGINT, groups in flight get this long to be stored; the rest are abandoned
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)


def item_stream(items: list, seed: int) -> Iterator:
    """Epochs over the items, each in a fresh seeded order."""
    rng = random.Random(seed)
    while True:
        order = list(items)
        rng.shuffle(order)
        yield from order


def unstored_items(items: list, seed: int, position: Position) -> Iterator[tuple[int, object]]:
    """(group index, item) of the stream, skipping the groups `position` says are stored."""
    for index, item in enumerate(item_stream(items, seed)):
        if not position.is_stored(index):
            yield index, item


class GroupProducer:
    """The admission loop over groups. `config` needs group_size, groups_per_batch, versions_per_batch,
    max_staleness, concurrency, max_groups, seed, stats_path, rpc_timeout_s, admission_poll_s, producer_id,
    position_path, trajectory_log; `tokenizer` spells the logged tokens unless trajectory_log names one."""

    stats: dict
    rollout: object
    buffer: object

    def __init__(self, config, channels: list, tokenizer: str | None = None):
        self.config = config
        self.channels = channels
        self.position = Position.load(config.position_path)
        self.producer_id = self.position.new_producer_id(config.producer_id)
        self.gauge = Gauge(self._poll_pipeline, config.admission_poll_s, self._watch_version)
        self.version = 0
        self.groups_started = 0
        self.in_flight_samples = 0  # of groups started and not yet stored
        self.idle_s = 0.0  # nothing in flight while admission refused: generation waiting on the trainer
        self.stored_samples = 0  # of groups stored (Put returned, or every episode closed)
        self.started_at = time.monotonic()
        self._retry_log = Sparse(10.0)
        self.trajectories = TrajectoryLog(config.trajectory_log, tokenizer)

    async def run_group(self, item, group_index: int) -> None:
        raise NotImplementedError

    async def before_wait(self) -> None:
        """Called before the producer waits (for admission, for a group in flight, for the last groups): the groups
        started since the last wait are every group it starts at once (Driver sends them as one request)."""

    def snapshot(self) -> dict:
        raise NotImplementedError

    def log_group(self, kind: str, group_index: int, samples: Callable[[], Sequence], prompt: dict | None = None,
                  extra: Callable[[], Sequence[dict]] = tuple) -> None:
        """Hand a stored group to the trajectory log when it samples this one: `samples()` (protos.sample.Sample),
        `extra()` (more fields of each sample's record) and the record are made on its writer thread, with the
        versions known now (trajectory_log.group_record)."""
        if not self.trajectories.wants(group_index):
            return
        reading, served, producer, now = self.gauge.reading, self.version, self.producer_id, time.time()
        trainer = reading.trainer_version if reading is not None else 0
        self.trajectories.offer(group_index, lambda spell: group_record(
            kind, samples(), producer, trainer, served, spell, now, prompt, extra()))

    async def close(self) -> None:
        self.trajectories.close()
        self.gauge.close()
        for channel in self.channels:
            await channel.close()

    async def _admit(self, stop: asyncio.Event) -> bool:
        """The one place asynchrony is bounded: wait until one more group may start (False: stopped)."""
        cfg = self.config
        polled_at = None
        while not stop.is_set():
            reading = await self.gauge.read(self.stored_samples)
            now = time.monotonic()
            if polled_at is not None and self.in_flight_samples == 0:  # refused, and the rollout has none of ours
                self.idle_s += now - polled_at
            polled_at = now
            queued = reading.buffered + self.in_flight_samples + (self.stored_samples - reading.put_mark)
            pipeline = Pipeline(reading.trainer_version, reading.served_version, queued)
            if admit(pipeline, cfg.group_size, cfg.groups_per_batch * cfg.group_size, cfg.versions_per_batch,
                     cfg.max_staleness):
                return True
            await self.before_wait()
            await self.gauge.pause()
        return False

    async def _poll_pipeline(self, served: int | None) -> tuple[int, int, int]:
        """Buffer Stats, and the rollout's version unless a watch says it (`served`)."""
        if served is None:
            stats, reply = await asyncio.gather(
                self._call(self.buffer.Stats, buffer_pb2.StatsRequest(), "Stats"),
                self._call(self.rollout.GetWeightVersion, rollout_pb2.GetWeightVersionRequest(), "GetWeightVersion"))
            served = reply.version
        else:
            stats = await self._call(self.buffer.Stats, buffer_pb2.StatsRequest(), "Stats")
        self.version = served
        # -1: no trainer has reported yet; its first batch trains at version 0 or later.
        trainer_version = max(stats.trainer_version, 0)
        return trainer_version, served, stats.pending + stats.leased - stats.consumed

    async def _watch_version(self, served: int) -> int:
        """The rollout's version once it is not `served` (or after WATCH_S); one try, no retries: the poll retries."""
        reply = await self.rollout.GetWeightVersion(
            rollout_pb2.GetWeightVersionRequest(newer_than=served, wait_s=WATCH_S), timeout=WATCH_S + 10.0)
        return reply.version

    async def _call(self, rpc, request, what: str = ""):
        """Call with retries on transient statuses (a restarted service, back-pressure)."""
        for attempt in itertools.count():
            try:
                return await rpc(request, timeout=self.config.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE or attempt >= 600:
                    raise
                self.stats["retries"] += 1
                # A service down or unreachable shows in the log at once (then at most every 10 s), not only in
                # the stats' retry count; back-pressure (RESOURCE_EXHAUSTED) is the buffer working as meant.
                unreachable = exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
                level = logging.WARNING if unreachable and self._retry_log.level() == logging.INFO else logging.DEBUG
                log.log(level, "%s: %s (%s), retrying; %d retries so far", what, exc.code().name, exc.details(),
                        self.stats["retries"])
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))

    async def _run_counted(self, item, group_index: int) -> None:
        """run_group, its samples counted in flight (from admission) until they are stored; then the position
        moves past it."""
        size = self.config.group_size
        try:
            with span("driver.group", group_index=group_index):  # a traced group's root: its admission to its Put
                await self.run_group(item, group_index)
            self.position.stored(group_index)
        finally:
            self.in_flight_samples -= size
            self.stored_samples += size

    async def run(self, items: list, stop: asyncio.Event | None = None) -> None:
        cfg = self.config
        stop = stop or asyncio.Event()
        stream = unstored_items(items, cfg.seed, self.position)
        in_flight: set[asyncio.Task] = set()
        reporter = asyncio.create_task(self._report(stop)) if cfg.stats_path else None
        try:
            while not stop.is_set() and (cfg.max_groups == 0 or self.groups_started < cfg.max_groups):
                while len(in_flight) >= cfg.concurrency:
                    await self.before_wait()
                    done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        task.result()  # a failed group stops the producer with its error
                if not await self._admit(stop):
                    break
                index, item = next(stream)
                self.groups_started += 1
                self.in_flight_samples += cfg.group_size  # counted now: the next admission reads it
                in_flight.add(asyncio.create_task(self._run_counted(item, index)))
            await self.before_wait()
            for task in asyncio.as_completed(in_flight):
                await task
        finally:
            for task in in_flight:
                task.cancel()
            if reporter is not None:
                reporter.cancel()
                self._write_stats()

    async def run_to_end(self, items: list) -> dict:
        """run_until_signalled, then close; the final snapshot (what a producer process logs when it ends)."""
        try:
            await self.run_until_signalled(items)
        finally:
            await self.close()
        return self.snapshot()

    async def run_until_signalled(self, items: list) -> None:
        """run() until it ends or SIGTERM/SIGINT; then the groups in flight get STOP_GRACE_S to be stored and the
        rest are abandoned (not stored: a producer started again generates them again). Ctrl-C reaches every
        process of a job at once, so the services these groups wait on may be gone: unbounded, the stop waited
        on calls retried for minutes, until the job's supervisor killed the producer 20 s later."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        running, stopped = asyncio.create_task(self.run(items, stop)), asyncio.create_task(stop.wait())
        try:
            await asyncio.wait([running, stopped], return_when=asyncio.FIRST_COMPLETED)
            if not running.done():
                await asyncio.wait([running], timeout=STOP_GRACE_S)
            if not running.done():
                log.warning("stopping: groups still in flight after %gs are abandoned (not stored)", STOP_GRACE_S)
                running.cancel()
                await asyncio.wait([running])  # run()'s finally: in-flight groups cancelled, stats written
        finally:
            stopped.cancel()
        if not running.cancelled():
            running.result()  # a failed group's error

    def _write_stats(self) -> None:
        with open(self.config.stats_path, "a") as out:
            out.write(json.dumps(self.snapshot()) + "\n")

    async def _report(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(2.0)
            self._write_stats()


def run_producer(name: str, description: str, config_type: type, run: Callable[..., Awaitable[dict]],
                 argv: list[str] | None = None) -> int:
    """A producer as a process (`python -m rollout.driver`, `python -m rollout.envs.runner`): its config from
    --config / --set, `run(config)` until it is signalled, then its summary logged."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", help=f"YAML {config_type.__name__}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    config = load_config(config_type, args.config, args.set)
    logging.basicConfig(level="INFO", format=f"%(asctime)s %(levelname)s [{name}] %(message)s")
    setup_tracing(name, getattr(config, "tracing", None))
    try:
        summary = asyncio.run(run(config))
    finally:
        skip_final_collection()
    log.info("%s done: %s", name, json.dumps(summary))
    return 0
