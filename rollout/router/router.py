"""The rollout router's replica set: `relayrl serve rollout` with `router.replicas` (or `router.decode`) set serves
Rollout in front of several workers, each a whole `relayrl serve rollout` replica or a decode worker of a
prefill/decode split (rollout/pd/prefill.py). The RPCs are routed in rollout/router/service.py; this file holds
who the workers are, how busy, and which of them take traffic.

Each worker is polled (Rollout.GetLoad) every `poll_s`: running + waiting sequences, free KV blocks, the weight
version it serves. A request goes to the worker its routing key went to before while that worker is routed to
(affinity keeps a key's KV on one worker), else to the least loaded one: the sequences this router has in flight
to it (known now) plus the others it ran at the last poll (polled running + waiting, less this router's part). A worker that fails a poll or a forwarded call (UNAVAILABLE) is dropped from routing at once.

Replicas join and leave while a run goes on (Replicas RPCs, `relayrl deploy scale`):

    JOINING  -> polled, receives weights (the trainer publishes to every replica the router lists), no traffic;
                ACTIVE once it serves the weight version the routed replicas serve (at once when none is routed,
                or all serve their base weights)
    ACTIVE   -> routed to; one that dies, or stops answering polls, is JOINING again when it answers: a restarted
                replica serves its base weights until the trainer's next publish reaches it
    DRAINING -> (RemoveReplica) no new requests or sessions; it leaves the list once nothing this router sent it
                is in flight and the sessions pinned to it are closed, or at the drain timeout
"""

import asyncio
import contextlib
import enum
import json
import logging
import os
import pathlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from prometheus_client import Gauge
from pydantic import Field, model_validator

from protos import rollout_pb2, rollout_pb2_grpc
from services.config import ClientConfig, Strict

log = logging.getLogger(__name__)
LIVE_WORKERS = Gauge("relayrl_router_live_decode_workers", "Workers (replicas or decode workers) the router sends to")
_AFFINITY_KEYS = 100_000  # routing keys remembered (least recently used forgotten first)


class RouterSettings(Strict):
    """Rollout served by a router in front of workers (None in the rollout config: this process generates)."""

    replicas: list[str] = Field(default_factory=list, description="host:port of each rollout replica "
                                "(`relayrl serve rollout`) routed to from the start; more join by AddReplica.")
    decode: list[str] = Field(default_factory=list, description="host:port of each decode worker (`relayrl serve "
                              "decode`) of a prefill/decode split; routed like replicas.")
    replicas_file: str | None = Field(None, description="Where the router keeps its replica set across restarts of "
                                      "its own: written at start and on every AddReplica / RemoveReplica; when it "
                                      "exists at start, its addresses replace `replicas` (a run's launcher, "
                                      "deploy/local/replicas.py, names one in the run folder). None = `replicas` only.")
    client: ClientConfig = Field(default_factory=ClientConfig, description="How to reach the workers.")
    poll_s: float = Field(1.0, gt=0, description="How often each worker's load (and life) is read.")
    poll_timeout_s: float = Field(5.0, gt=0, description="A worker that does not answer a load poll within this is "
                                  "dropped from routing (a dead one is refused at once; a busy one answers slowly).")
    max_attempts: int = Field(3, gt=0, description="Workers a request is tried on before it fails UNAVAILABLE.")
    drain_timeout_s: float = Field(60.0, gt=0, description="RemoveReplica's wait for a replica's in-flight requests "
                                   "and open sessions when the call names none.")

    @model_validator(mode="after")
    def _some_worker(self):
        if not self.replicas and not self.decode:
            raise ValueError("router: give replicas or decode workers to route to")
        return self


class State(enum.IntEnum):
    """A worker's place in routing (the values of router.proto's ReplicaState)."""

    JOINING = 1
    ACTIVE = 2
    DRAINING = 3


@dataclass
class Worker:
    address: str
    channel: grpc.aio.Channel
    rollout: rollout_pb2_grpc.RolloutStub
    state: State = State.ACTIVE
    alive: bool = False
    load: rollout_pb2.GetLoadResponse = field(default_factory=rollout_pb2.GetLoadResponse)
    in_flight: int = 0  # requests this router has sent it and not yet had answered
    sequences: int = 0  # their sequences (n per request)
    sequences_at_poll: int = 0  # `sequences` when the last poll answered: the polled load's own part

    def busy(self) -> tuple[int, int]:
        """Sequences it has now: this router's (exact), and others' as of the last poll; then fewer free blocks."""
        others = max(0, self.load.running + self.load.waiting - self.sequences_at_poll)
        return self.sequences + others, -self.load.free_blocks

    def take(self, sequences: int) -> None:
        self.in_flight += 1
        self.sequences += sequences

    def give_back(self, sequences: int) -> None:
        self.in_flight -= 1
        self.sequences -= sequences

    @property
    def routed(self) -> bool:
        return self.alive and self.state == State.ACTIVE


class Router:
    """The workers, their loads and states; `choose` picks one for a request."""

    def __init__(self, settings: RouterSettings, connect: Callable[[str], grpc.aio.Channel]):
        self.settings = settings
        self._connect = connect
        self.workers: dict[str, Worker] = {}
        for address in [*self._kept_replicas(), *settings.decode]:
            self._add(address, State.ACTIVE)
        self._keep_replicas()
        self.affinity: OrderedDict[str, Worker] = OrderedDict()
        self.sessions: OrderedDict[str, Worker] = OrderedDict()  # open session id -> the worker that holds it
        self.changed = asyncio.Event()  # set after every poll and whenever a call to a worker ends
        self._poller: asyncio.Task | None = None

    def start(self) -> None:
        self._poller = asyncio.ensure_future(self._poll_forever())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for worker in self.workers.values():
            await worker.channel.close()

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll(worker) for worker in list(self.workers.values())))
        self._promote()
        self._count()

    def routed_version(self) -> int | None:
        """The weight version a joining replica must serve to be routed to (the highest a routed one serves)."""
        versions = [worker.load.weight_version for worker in self.workers.values() if worker.routed]
        return max(versions) if versions else None

    def choose(self, routing_key: str, exclude: set[str]) -> Worker | None:
        """The worker for a request (None when no routed worker is left outside `exclude`)."""
        sticky = self.affinity.get(routing_key) if routing_key else None
        if sticky is not None and sticky.routed and sticky.address not in exclude:
            self.affinity.move_to_end(routing_key)
            return sticky
        live = [worker for worker in self.workers.values() if worker.routed and worker.address not in exclude]
        if not live:
            return None
        worker = min(live, key=Worker.busy)
        if routing_key:
            self.affinity[routing_key] = worker
            if len(self.affinity) > _AFFINITY_KEYS:
                self.affinity.popitem(last=False)
        return worker

    def drop(self, worker: Worker, why: str) -> None:
        """Out of routing until a poll finds it again (then JOINING: it may have restarted on its base weights)."""
        if worker.alive:
            log.warning("worker %s dropped from routing: %s", worker.address, why)
        worker.alive = False
        if worker.state == State.ACTIVE:
            worker.state = State.JOINING
        self._count()

    def pinned(self, worker: Worker) -> int:
        """Sessions opened through this router that live on `worker`."""
        return sum(holder is worker for holder in self.sessions.values())

    # -- replicas joining and leaving --------------------------------------------------------------

    async def add(self, address: str, wait_s: float = 0.0) -> Worker:
        """Add a replica as JOINING (an address already known is left as it is); with `wait_s`, wait for it to be
        routed to."""
        worker = self.workers.get(address) or self._add(address, State.JOINING)
        self._keep_replicas()
        await self.poll()  # every worker: the version it is measured against is the one served now
        deadline = time.monotonic() + wait_s
        while worker.state == State.JOINING and time.monotonic() < deadline and address in self.workers:
            await self._changed(deadline - time.monotonic())
        return worker

    async def remove(self, address: str, timeout_s: float) -> tuple[int, int]:
        """Drain a replica and forget it: (requests, sessions) it still had when it left (0, 0: drained).
        KeyError for an address the router does not know."""
        worker = self.workers[address]
        worker.state = State.DRAINING
        self._count()
        log.info("replica %s draining (%d in flight, %d sessions)", address, worker.in_flight, self.pinned(worker))
        deadline = time.monotonic() + timeout_s
        while (worker.in_flight or self.pinned(worker)) and time.monotonic() < deadline and worker.alive:
            await self._changed(deadline - time.monotonic())
        left = (worker.in_flight, self.pinned(worker))
        del self.workers[address]
        self._keep_replicas()
        for table in (self.affinity, self.sessions):
            for key in [key for key, holder in table.items() if holder is worker]:
                del table[key]
        log.info("replica %s removed (%d in flight, %d sessions left)", address, *left)
        await worker.channel.close()
        return left

    def notify(self) -> None:
        """Wake whoever waits for a change (a call to a worker ended, a session closed)."""
        self.changed.set()

    # -- internals ---------------------------------------------------------------------------------

    def _kept_replicas(self) -> list[str]:
        """The replica set this router had before it restarted (its replicas_file), else the configured one."""
        path = self.settings.replicas_file
        if path and pathlib.Path(path).exists():
            kept = json.loads(pathlib.Path(path).read_text())["replicas"]
            log.warning("replicas from %s (this router's set before it restarted): %s", path, kept)
            return kept
        return list(self.settings.replicas)

    def _keep_replicas(self) -> None:
        """Write the replica set to replicas_file, whole or not at all."""
        if not self.settings.replicas_file:
            return
        path = pathlib.Path(self.settings.replicas_file)
        replicas = [address for address in self.workers if address not in self.settings.decode]
        staging = path.with_name(f".{path.name}.tmp")
        staging.write_text(json.dumps({"replicas": replicas}))
        os.replace(staging, path)

    def _add(self, address: str, state: State) -> Worker:
        channel = self._connect(address)
        worker = self.workers[address] = Worker(address, channel, rollout_pb2_grpc.RolloutStub(channel), state)
        return worker

    async def _changed(self, timeout: float) -> None:
        self.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), max(timeout, 0.0))

    def _promote(self) -> None:
        target = self.routed_version()
        for worker in self.workers.values():
            if worker.state == State.JOINING and worker.alive and (target is None or
                                                                   worker.load.weight_version >= target):
                worker.state = State.ACTIVE
                log.info("replica %s routed to (weight version %d)", worker.address, worker.load.weight_version)

    def _count(self) -> None:
        LIVE_WORKERS.set(sum(worker.routed for worker in self.workers.values()))
        self.notify()

    async def _poll(self, worker: Worker) -> None:
        try:
            sequences = worker.sequences
            worker.load = await worker.rollout.GetLoad(rollout_pb2.GetLoadRequest(),
                                                       timeout=self.settings.poll_timeout_s)
            worker.sequences_at_poll = min(sequences, worker.sequences)  # in flight all along the poll
        except grpc.aio.AioRpcError as exc:
            self.drop(worker, f"GetLoad: {exc.code().name}")
            return
        if not worker.alive:
            log.info("worker %s answers (weight version %d)", worker.address, worker.load.weight_version)
        worker.alive = True

    async def _poll_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.settings.poll_s)
