"""Publish versioned weights from the trainer to rollout workers.

Control over gRPC (relayrl.weights.v1.WeightSync), data over a process group (services.weights):

    BeginUpdate(manifest, group) -> every receiver, concurrently; each validates and starts receiving
    rendezvous (new groups only) -> broadcast the buckets from rank 0 (this process), and meanwhile
    CommitUpdate -> every receiver, concurrently; each answers once it holds every bucket and has
                    switched between two decode steps

Every step has a deadline. A receiver that fails Begin is left out of this publish (the group is formed
without it); a failed rendezvous or transfer fails the publish for its members, who keep their old
version (one that already held every bucket and switched says so in its result). Failures are
reported in the PublishReport, never raised, and the next publish tries every receiver again. A receiver
that refuses the version as not newer than the one it serves is marked `not_newer` in its result: the
caller's counter is behind (a restarted trainer), and `served_versions()` says where the receivers are.
A receiver that restarted (at version 0) is simply in the next publish: a kept group it no longer holds
is answered ABORTED and a new group is formed with it.

The group is kept across publishes while its membership is unchanged and every step succeeded:
a rendezvous costs ~0.2-0.5 s on loopback, more than the transfer of a small model. Any failure drops
the group and the next publish forms a new one under a new name.

Receivers whose engine joins the group itself (SGLang: init_weights_update_group / update_weights_from_distributed)
say so in their BeginUpdate reply (tensor_broadcasts): their group is formed as torch.distributed forms a named
group (services/weights/torch_group.py) and carries one broadcast per tensor instead of buckets. One group holds
receivers of one kind; a publish to both kinds fails for all of them, saying so.

Two ways in: `WeightBroadcaster` (asyncio: `await publish(...)`) and `BlockingWeightBroadcaster` (a
synchronous training loop: `publish(...)` blocks, the asyncio side runs on a private thread).
"""

import asyncio
import logging
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Self

import grpc
import torch
from pydantic import Field

from protos import rollout_pb2, rollout_pb2_grpc, weights_pb2, weights_pb2_grpc
from services.client import connect
from services.config import ClientConfig, Strict
from services.weights import (
    BucketSender,
    GroupSpec,
    Manifest,
    TensorSlot,
    Transfer,
    TransferError,
    allocate_staging,
    bind_to_buckets,
    deadline_after,
    host_store,
    make_group,
    merge_order,
    plan_buckets,
    send_tensors,
    transfer_device,
    unpack_buckets,
)
from services.weights.manifest import ALIGN_BYTES
from services.weights.torch_group import make_torch_group

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BroadcastConfig(Strict):
    """How the trainer publishes weights."""

    backend: Literal["gloo", "nccl", "cupy_nccl"] = Field(
        "gloo", description="Collective for the tensors: gloo (CPU), nccl (GPU, torch's ProcessGroupNCCL) or cupy_nccl "
        "(GPU, cupy's NCCL bindings: the `gpu` extra). The NCCL ones need every member on a GPU of its own.")
    bucket_mb: float = Field(32.0, gt=0, description="Tensors are packed into buckets of up to this many MiB; "
                             "packing the next bucket overlaps sending this one. On gloo, 32-64 MiB beat smaller "
                             "buckets and one broadcast per tensor: each collective has a fixed cost in time and CPU.")
    solo_mb: float | None = Field(None, ge=0, description="Tensors of this many MiB or more travel alone, straight "
                                  "from their memory (no packing copy); None = bucket_mb.")
    timeout_s: float = Field(60.0, gt=0, description="Deadline of rendezvous + transfer, and of every collective.")
    control_timeout_s: float = Field(10.0, gt=0, description="Deadline of each BeginUpdate/AbortUpdate call, and "
                                     "what CommitUpdate may add for the switch itself.")
    master_addr: str = Field("127.0.0.1", description="Address at which receivers reach this trainer's rendezvous store "
                             "and gloo group; both bind this interface only (loopback: unreachable from other hosts).")
    master_port: int = Field(0, ge=0, le=65535, description="Port of the rendezvous store; 0 = any free port.")
    keep_group: bool = Field(True, description="Reuse the group across publishes while its members are unchanged.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="Cast floating tensors to this dtype before sending (the rollout engine's); None = as is."
    )
    client: ClientConfig = Field(default_factory=ClientConfig, description="How to reach the receivers.")

    @property
    def publish_bound_s(self) -> float:
        """The longest one publish can take, whatever its receivers do: two Begin rounds, rendezvous +
        transfer, commit and aborts, each within its own deadline."""
        return 2 * self.timeout_s + 8 * self.control_timeout_s


@dataclass
class ReceiverResult:
    """What one receiver did with one publish."""

    address: str
    ok: bool
    error: str | None = None
    version: int | None = None  # the version it serves after this publish, when it said so
    not_newer: bool = False  # BeginUpdate refused the version: the receiver serves this one or a later one
    receive_s: float = 0.0
    switch_s: float = 0.0


@dataclass
class PublishReport:
    """Outcome and timings of one publish."""

    version: int
    results: list[ReceiverResult]
    bytes: int = 0
    begin_s: float = 0.0  # BeginUpdate round(s)
    rendezvous_s: float = 0.0  # forming a new group (0 when reused)
    transfer_s: float = 0.0  # broadcasting every bucket
    commit_s: float = 0.0  # waiting for the CommitUpdate replies after the last bucket went out
    total_s: float = 0.0
    group_reused: bool = False

    @property
    def ok(self) -> bool:
        """Every receiver switched to the new version."""
        return bool(self.results) and all(r.ok for r in self.results)

    @property
    def failed(self) -> dict[str, str]:
        return {r.address: r.error or "failed" for r in self.results if not r.ok}

    @property
    def not_newer(self) -> list[str]:
        """Receivers that refused this version as not newer than the one they serve."""
        return [r.address for r in self.results if r.not_newer]


@dataclass
class _Group:
    members: tuple[str, ...]
    name: str
    transfer: Transfer | None = None  # None until this process has joined
    # The members take one broadcast per tensor on a torch.distributed named group (their BeginUpdate said so:
    # SGLang receiving itself); False: buckets on this project's own group.
    tensor_broadcasts: bool = False

    def spec(self, rank: int, master_addr: str, port: int, backend: str) -> GroupSpec:
        return GroupSpec(backend, master_addr, port, len(self.members) + 1, rank, self.name,  # type: ignore[arg-type]
                         existing=self.transfer is not None)


class _MixedGroup(Exception):
    """BeginUpdate replies disagree on tensor_broadcasts: some members receive per tensor, others buckets."""

    def __init__(self, per_tensor: list[str]):
        super().__init__(per_tensor)
        self.per_tensor = per_tensor


def _describe(error: grpc.RpcError) -> str:
    return f"{error.code().name}: {error.details()}"


class WeightBroadcaster:
    """Publishes named tensors as versioned weights to rollout workers at `receivers` (host:port).

    `await publish(named_tensors, version)` returns a PublishReport and never raises for a receiver's
    failure. Call `await close()` at the end (or use `async with`). `device`: this process's CUDA device
    (cuda:N) for the NCCL backends, where buckets are packed and sent from; None = the published tensors'.
    """

    def __init__(self, receivers: Sequence[str], config: BroadcastConfig | None = None,
                 device: torch.device | str | None = None):
        self.config = config or BroadcastConfig()
        self.receivers = list(receivers)
        self.device = None if device is None else transfer_device(self.config.backend, device)
        self._bucket_bytes = int(self.config.bucket_mb * (1 << 20))
        solo_mb = self.config.bucket_mb if self.config.solo_mb is None else self.config.solo_mb
        self._solo_bytes = int(solo_mb * (1 << 20))
        self._sender = BucketSender()
        self._token = uuid.uuid4().hex[:8]
        self._groups_planned = 0
        self._group: _Group | None = None
        self._store = None
        self._stubs: dict[str, weights_pb2_grpc.WeightSyncStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._channel_of: dict[str, grpc.aio.Channel] = {}
        self._manifest: tuple[tuple, Manifest] | None = None
        self._wire: tuple[Manifest, list[weights_pb2.TensorSpec], list[int]] | None = None  # its BeginUpdate fields
        self._bound: tuple[Manifest, list[torch.Tensor]] | None = None  # bind(): the layout, the parameters' buffers
        self._snapshot: list[torch.Tensor] | None = None  # snapshot(): a second set of buffers in that layout

    def set_receivers(self, receivers: Sequence[str]) -> None:
        """Change who receives from the next publish on (replicas added or removed)."""
        self.receivers = list(receivers)

    def bind(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """Move `parameters` (a model's, updated in place by its optimizer) into one buffer laid out as a
        single bucket, so that every later publish of them is one broadcast straight from their memory:
        no packing copy, no per-bucket cost. For a model held whole in this process, published while it
        is not being updated (a publish overlapping the next optimizer step would send a mix of two
        steps); with `dtype` set, publishes send cast copies instead, so binding is refused."""
        if self.config.dtype is not None:
            raise ValueError("bind: publishes cast the tensors to config.dtype, so they never send from the parameters")
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in self._prepare(parameters).items())
        whole = sum(TensorSlot(name, shape, dtype, 0, 0).nbytes for name, shape, dtype in key) + ALIGN_BYTES * len(key)
        self._manifest = (key, plan_buckets(merge_order(key), whole, solo_bytes=whole + 1))
        self._bound = (self._manifest[1], bind_to_buckets(parameters, self._manifest[1]))
        self._snapshot = None

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the bound parameters as they are now (one memcpy into a second buffer kept for this),
        by name and laid out like them: a publish of it also goes straight from its memory, while the
        parameters change (a publish overlapping the next optimizer step). Valid until the next snapshot;
        take it only when no publish of the previous one is in flight."""
        if self._bound is None:
            raise RuntimeError("snapshot: bind() the parameters first")
        manifest, buffers = self._bound
        if self._snapshot is None:
            self._snapshot = allocate_staging(manifest, buffers[0].device)
        with torch.no_grad():
            for source, copy in zip(buffers, self._snapshot, strict=True):
                copy.copy_(source)
        return unpack_buckets(manifest, self._snapshot)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.to_thread(self._drop_group, self.config.control_timeout_s)
        self._store = None
        for channel in self._channels:
            await channel.close()
        self._channels.clear()
        self._stubs.clear()
        self._channel_of.clear()

    async def served_versions(self, addresses: Sequence[str] | None = None) -> dict[str, int | None]:
        """The weight version each receiver (a rollout worker) serves now (GetWeightVersion); None for one
        that does not answer within control_timeout_s."""
        addresses = list(self.receivers if addresses is None else addresses)

        async def one(address: str) -> int | None:
            self._stub(address)
            stub = rollout_pb2_grpc.RolloutStub(self._channel_of[address])
            try:
                reply = await stub.GetWeightVersion(rollout_pb2.GetWeightVersionRequest(),
                                                    timeout=self.config.control_timeout_s)
            except grpc.RpcError as exc:
                log.warning("GetWeightVersion of %s: %s", address, _describe(exc))
                return None
            return reply.version

        return dict(zip(addresses, await asyncio.gather(*(one(a) for a in addresses)), strict=True))

    async def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> PublishReport:
        """Send `named_tensors` as version `version` to every receiver; see the module docstring."""
        start = time.perf_counter()
        tensors = self._prepare(named_tensors)
        manifest = self._plan(tensors)
        report = PublishReport(version, [], bytes=manifest.total_bytes)
        results: dict[str, ReceiverResult] = {}

        members, group = await self._begin_round(manifest, version, results)
        report.begin_s = time.perf_counter() - start
        report.group_reused = group is not None and group.transfer is not None
        if members and group is not None:
            await self._transfer_and_commit(group, manifest, tensors, version, results, report)
        report.results = [results[address] for address in self.receivers if address in results]
        report.total_s = time.perf_counter() - start
        if report.failed:
            log.warning("publish of version %d: %d/%d receivers failed: %s", version, len(report.failed),
                        len(report.results), report.failed)
        return report

    # -- the protocol's steps ----------------------------------------------------------------------

    async def _begin_round(
        self, manifest: Manifest, version: int, results: dict[str, ReceiverResult]
    ) -> tuple[list[str], _Group | None]:
        """BeginUpdate to every receiver. If some fail, the others are told to abort and the round starts
        again on a new group without the failed ones (at most three rounds)."""
        members = list(self.receivers)
        for _ in range(3):
            if not members:
                return [], None
            group = self._group_for(members)
            reused = group.transfer is not None
            try:
                errors = await self._begin(group, manifest, version)
            except _MixedGroup as mixed:
                await self._abort(members, version)
                self._drop_group()
                why = (f"BeginUpdate: {', '.join(mixed.per_tensor)} receive one broadcast per tensor (an engine that "
                       "joins the group itself: SGLang), the others buckets; one group cannot carry both")
                for address in members:
                    results[address] = ReceiverResult(address, False, why)
                return [], None
            if not errors:
                return members, group
            await self._abort([m for m in members if m not in errors], version)
            self._drop_group()
            for address, error in errors.items():
                # ABORTED on a reused group: the receiver no longer holds it (it restarted); a new group
                # fixes that, so it stays in.
                if not (reused and error.code() == grpc.StatusCode.ABORTED):
                    not_newer = error.code() == grpc.StatusCode.FAILED_PRECONDITION and "not newer" in error.details()
                    results[address] = ReceiverResult(address, False, f"BeginUpdate {_describe(error)}",
                                                      not_newer=not_newer)
                    members.remove(address)
        for address in members:
            results[address] = ReceiverResult(address, False, "BeginUpdate kept failing while the group changed")
        return [], None

    async def _begin(self, group: _Group, manifest: Manifest, version: int) -> dict[str, grpc.RpcError]:
        """BeginUpdate to the group's members, concurrently; the errors by address."""
        await self._ensure_store()
        if self._wire is None or self._wire[0] is not manifest:
            self._wire = (manifest, *manifest.to_proto())
        _, specs, bucket_sizes = self._wire

        async def one(rank: int, address: str) -> weights_pb2.BeginUpdateResponse:
            spec = group.spec(rank, self.config.master_addr, self._store.port, self.config.backend)
            request = weights_pb2.BeginUpdateRequest(
                version=version, tensors=specs, bucket_sizes=bucket_sizes, group=spec.to_proto(),
                timeout_s=self.config.timeout_s,
            )
            return await self._stub(address).BeginUpdate(request, timeout=self.config.control_timeout_s)

        replies = await asyncio.gather(
            *(one(rank, address) for rank, address in enumerate(group.members, start=1)), return_exceptions=True
        )
        errors, per_tensor = {}, {}
        for address, reply in zip(group.members, replies, strict=True):
            if isinstance(reply, grpc.RpcError):
                errors[address] = reply
            elif isinstance(reply, BaseException):
                raise reply
            else:
                per_tensor[address] = reply.tensor_broadcasts
        if not errors and len(set(per_tensor.values())) > 1:
            raise _MixedGroup(sorted(a for a, flag in per_tensor.items() if flag))
        if per_tensor and not errors:
            group.tensor_broadcasts = next(iter(per_tensor.values()))
        return errors

    async def _transfer_and_commit(
        self, group: _Group, manifest: Manifest, tensors: dict[str, torch.Tensor], version: int,
        results: dict[str, ReceiverResult], report: PublishReport,
    ) -> None:
        deadline = deadline_after(self.config.timeout_s)
        step = "rendezvous"
        started = time.perf_counter()
        pending: list[asyncio.Task] = []
        try:
            if group.transfer is None:
                spec = group.spec(0, self.config.master_addr, self._store.port, self.config.backend)
                device = self.device if self.device is not None else next(iter(tensors.values())).device
                form = make_torch_group if group.tensor_broadcasts else make_group
                group.transfer = await asyncio.to_thread(form, spec, self.config.timeout_s, self._store, device)
            report.rendezvous_s = time.perf_counter() - started
            step = "transfer"
            started = time.perf_counter()
            # CommitUpdate travels with the buckets: a receiver answers once it holds them all and has switched,
            # so no round trip is left to make after the last byte.
            pending = [asyncio.create_task(self._commit(address, version, deadline)) for address in group.members]
            send = send_tensors if group.tensor_broadcasts else self._sender.send
            await asyncio.to_thread(send, group.transfer, manifest, tensors, deadline)
            report.transfer_s = time.perf_counter() - started
        except TransferError as exc:
            for address in group.members:
                results[address] = ReceiverResult(address, False, f"{step} failed: {exc}")
            self._drop_group()
            await self._abort(list(group.members), version)
            for result in await asyncio.gather(*pending):
                if result.ok:  # it had every byte and switched before the abort came
                    results[result.address] = result
            return
        except BaseException:  # cancelled, or a bug: leave no CommitUpdate call behind
            for task in pending:
                task.cancel()
            raise
        started = time.perf_counter()
        commits = await asyncio.gather(*pending)
        report.commit_s = time.perf_counter() - started
        for result in commits:
            results[result.address] = result
        if not all(result.ok for result in commits) or not self.config.keep_group:
            self._drop_group()

    async def _commit(self, address: str, version: int, deadline: float) -> ReceiverResult:
        wait_s = max(deadline - time.monotonic(), self.config.control_timeout_s)
        request = weights_pb2.CommitUpdateRequest(version=version, timeout_s=wait_s)
        try:
            reply = await self._stub(address).CommitUpdate(request, timeout=wait_s + self.config.control_timeout_s)
        except grpc.RpcError as exc:
            return ReceiverResult(address, False, f"CommitUpdate {_describe(exc)}")
        return ReceiverResult(address, True, version=reply.current_version, receive_s=reply.receive_s,
                              switch_s=reply.switch_s)

    async def _abort(self, addresses: Sequence[str], version: int) -> None:
        """Tell receivers to drop `version`; one that cannot be reached keeps it only until its own deadline."""
        request = weights_pb2.AbortUpdateRequest(version=version)
        replies = await asyncio.gather(
            *(self._stub(a).AbortUpdate(request, timeout=self.config.control_timeout_s) for a in addresses),
            return_exceptions=True,
        )
        for address, reply in zip(addresses, replies):
            if isinstance(reply, grpc.RpcError):
                log.warning("AbortUpdate to %s: %s", address, _describe(reply))
            elif isinstance(reply, BaseException):
                raise reply

    # -- state -------------------------------------------------------------------------------------

    def _prepare(self, named_tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Detach, cast if configured, and send a tensor seen under two names once, under its first name:
        a tied model's state dict holds the embedding again as lm_head.weight, which the rollout engine
        does not count as a parameter of its own."""
        cast = _DTYPES.get(self.config.dtype) if self.config.dtype else None
        prepared, seen = {}, set()
        for name, tensor in named_tensors.items():
            tensor = tensor.detach()
            view = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            if tensor.numel() and view in seen:
                continue
            seen.add(view)
            prepared[name] = tensor.to(cast) if cast is not None and tensor.is_floating_point() else tensor
        return prepared

    def _plan(self, tensors: Mapping[str, torch.Tensor]) -> Manifest:
        """The bucket layout (in merge order: receivers adopt the staged bytes without a copy), recomputed
        only when names, shapes or dtypes change."""
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items())
        if self._manifest is None or self._manifest[0] != key:
            self._manifest = (key, plan_buckets(merge_order(key), self._bucket_bytes, self._solo_bytes))
        return self._manifest[1]

    def _group_for(self, members: list[str]) -> _Group:
        """The kept group if its members are these, else a new one under a name no store has seen."""
        if self._group is not None and self._group.members == tuple(members):
            return self._group
        self._drop_group()
        self._groups_planned += 1
        self._group = _Group(tuple(members), f"relayrl-wsync-{self._token}-{self._groups_planned}")
        return self._group

    def _drop_group(self, wait_s: float = 0.0) -> None:
        if self._group is not None and self._group.transfer is not None:
            self._group.transfer.close(wait_s)
        self._group = None

    async def _ensure_store(self) -> None:
        if self._store is None:
            self._store = await asyncio.to_thread(host_store, self.config.master_addr, self.config.timeout_s,
                                              self.config.master_port)

    def _stub(self, address: str) -> weights_pb2_grpc.WeightSyncStub:
        if address not in self._stubs:
            channel = connect(address, self.config.client)
            self._channels.append(channel)
            self._channel_of[address] = channel
            self._stubs[address] = weights_pb2_grpc.WeightSyncStub(channel)
        return self._stubs[address]


class BlockingWeightBroadcaster:
    """A WeightBroadcaster for synchronous code: `publish` blocks; the asyncio side runs on its own thread."""

    def __init__(self, receivers: Sequence[str], config: BroadcastConfig | None = None,
                 device: torch.device | str | None = None):
        self.broadcaster = WeightBroadcaster(receivers, config, device)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-broadcast", daemon=True)
        self._thread.start()

    def publish(self, named_tensors: Mapping[str, torch.Tensor], version: int) -> PublishReport:
        return self._run(self.broadcaster.publish(named_tensors, version), self.broadcaster.config.publish_bound_s)

    def served_versions(self, addresses: Sequence[str] | None = None) -> dict[str, int | None]:
        return self._run(self.broadcaster.served_versions(addresses), 2 * self.broadcaster.config.control_timeout_s)

    def bind(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """WeightBroadcaster.bind; call it while no publish is in flight."""
        self.broadcaster.bind(parameters)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """WeightBroadcaster.snapshot; call it while no publish is in flight."""
        return self.broadcaster.snapshot()

    def set_receivers(self, receivers: Sequence[str]) -> None:
        self._loop.call_soon_threadsafe(self.broadcaster.set_receivers, list(receivers))

    def close(self) -> None:
        self._run(self.broadcaster.close(), self.broadcaster.config.control_timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self.broadcaster.config.control_timeout_s)

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)
