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

The group is kept across publishes while its membership is unchanged and every step succeeded (transport.py);
any failure drops it and the next publish forms a new one under a new name. Which tensors go out, in which
bucket, is plan.py's.

Receivers whose engine joins the group itself (SGLang: init_weights_update_group / update_weights_from_distributed)
say so in their BeginUpdate reply (tensor_broadcasts): their group is formed as torch.distributed forms a named
group (services/weights/torch_group.py) and carries one broadcast per tensor instead of buckets. One group holds
receivers of one kind; a publish to both kinds fails for all of them, saying so.

With `delta: auto` a version goes as a change of the last one every receiver took (trainer/broadcast/delta.py):
BeginUpdate names that base_version and each bucket's part; a receiver that does not hold it answers needs_full, and
the round starts again with the whole version (counted in PublishReport.fallbacks). With `adapter` (a LoRA policy)
the same protocol carries the base once and then the adapter buckets alone (trainer/broadcast/adapter.py).

With several senders (`use_senders`: pipeline stages, trainer/broadcast/senders.py) this process is sender 0: it
gathers the other senders' layouts, plans one version whose buckets each belong to one sender, names every sender's
group in BeginUpdate (sender_groups) and each bucket's sender in its part, starts each round on every sender with its
assignment, and sends its own buckets; the receivers commit once every sender's part has arrived.

Two ways in: `WeightBroadcaster` (asyncio: `await publish(...)`) and `BlockingWeightBroadcaster` (blocking.py: a
synchronous training loop: `publish(...)` blocks, the asyncio side runs on a private thread).
"""

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Self

import grpc
import torch

from protos import rollout_pb2, rollout_pb2_grpc, weights_pb2, weights_pb2_grpc
from services.client import connect
from services.weights import GroupSpec, Manifest, TransferError, deadline_after, transfer_device
from trainer.broadcast.adapter import AdapterEncoder
from trainer.broadcast.config import BroadcastConfig
from trainer.broadcast.delta import DeltaEncoder, Outgoing
from trainer.broadcast.gather import ShardedWeights
from trainer.broadcast.plan import BroadcastPlan
from trainer.broadcast.report import PublishReport, ReceiverResult
from trainer.broadcast.senders import Peers, join_parts, pack_part, sender_spec
from trainer.broadcast.transport import Group, Tensors, Transport

log = logging.getLogger(__name__)


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
        self._plan = BroadcastPlan(self.config)
        device = None if device is None else transfer_device(self.config.backend, device)
        self._transport = Transport(self.config, device)
        self._stubs: dict[str, weights_pb2_grpc.WeightSyncStub] = {}
        self._channels: list[grpc.aio.Channel] = []
        self._channel_of: dict[str, grpc.aio.Channel] = {}
        self._delta: DeltaEncoder | AdapterEncoder | None = (
            AdapterEncoder() if self.config.adapter else DeltaEncoder() if self.config.delta == "auto" else None)
        self._partial: dict[str, bool] = {}  # whether each receiver said it applies partial updates
        self._took: dict[str, int | None] = {}  # the last version each receiver took whole (delta sync's base)
        self._peers: Peers | None = None  # the other senders (use_senders)
        self._senders = 1  # how many senders this publish has (use_senders: the stages)

    def use_senders(self, peers: Peers) -> None:
        """Publish every version from several senders: this process is sender 0 and publishes its own tensors,
        `peers` are the others (trainer/broadcast/senders.py). Over gloo and whole versions only, for now (no delta,
        no adapter, no CUDA IPC: every sender's group is a gloo group on the CPU)."""
        if self.config.backend != "gloo" or self.config.delta == "auto" or self.config.adapter:
            raise ValueError(f"several senders: backend gloo and whole versions only for now, not backend "
                             f"{self.config.backend!r}, delta {self.config.delta!r}, adapter {self.config.adapter}")
        self.config = self._transport.config = self.config.model_copy(update={"cuda_ipc": False})
        self._plan.config = self.config
        self._peers = peers

    def end_publish(self) -> None:
        """With several senders: the publish (all its rounds) is over, the other senders stop following it
        (collective among the senders; blocking). Nothing otherwise."""
        if self._peers is not None:
            self._peers.end()

    def set_receivers(self, receivers: Sequence[str]) -> None:
        """Change who receives from the next publish on (replicas added or removed)."""
        self.receivers = list(receivers)

    def bind(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """Move `parameters` (a model's, updated in place by its optimizer) into one buffer laid out as a
        single bucket, so that every later publish of them is one broadcast straight from their memory:
        no packing copy, no per-bucket cost. For a model held whole in this process, published while it
        is not being updated (a publish overlapping the next optimizer step would send a mix of two
        steps); with `dtype` set, publishes send cast copies instead, so binding is refused."""
        self._plan.bind(parameters)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the bound parameters as they are now (one memcpy into a second buffer kept for this),
        by name and laid out like them: a publish of it also goes straight from its memory, while the
        parameters change (a publish overlapping the next optimizer step). Valid until the next snapshot;
        take it only when no publish of the previous one is in flight."""
        return self._plan.snapshot()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._transport.close()
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

    async def publish(self, named_tensors: Tensors, version: int) -> PublishReport:
        """Send `named_tensors` as version `version` to every receiver; see the module docstring. Sharded weights
        (trainer/broadcast/gather.py) are gathered into each bucket as it goes out; the caller calls their
        `finish()` afterwards (rank 0 like every other rank)."""
        start = time.perf_counter()
        tensors = self._plan.prepare(named_tensors)
        forms = None
        if self._peers is not None:
            manifest, own = await self._from_senders(tensors)
            forms = (own, own)
        else:
            manifest = self._plan.manifest(tensors)
        if self._delta is not None and not isinstance(tensors, ShardedWeights):
            forms = await asyncio.to_thread(self._delta.encode, manifest, tensors, self._partial_ok())
        report = PublishReport(version, [], bytes=manifest.total_bytes, full_bytes=manifest.total_bytes)
        results: dict[str, ReceiverResult] = {}

        members, group, outgoing = await self._begin_round(manifest, version, results, forms)
        report.begin_s = time.perf_counter() - start
        report.group_reused = group is not None and group.transfer is not None
        if outgoing is not None and self._peers is None:
            report.bytes, report.partial = outgoing.bytes, outgoing.base_version != 0
        if members and group is not None:
            await self._transfer_and_commit(group, manifest, tensors, version, results, report, outgoing)
        report.results = [results[address] for address in self.receivers if address in results]
        if forms is not None and self._delta is not None:
            for result in report.results:  # a receiver that failed may hold anything: it gets the next version whole
                self._took[result.address] = version if result.ok else None
            if any(result.ok for result in report.results):
                self._delta.taken(version)
            report.fallbacks = self._delta.fallbacks
        report.total_s = time.perf_counter() - start
        if report.failed:
            log.warning("publish of version %d: %d/%d receivers failed: %s", version, len(report.failed),
                        len(report.results), report.failed)
        return report

    async def _from_senders(self, tensors: Mapping[str, torch.Tensor]) -> tuple[Manifest, Outgoing]:
        """Several senders: the version's manifest, every sender's buckets one sender after the other, and this
        sender's part of it (every bucket's part names its sender and checksum; only this sender's go out from here)."""
        if isinstance(tensors, ShardedWeights):
            raise TypeError("several senders publish tensors held whole by each sender, not ShardedWeights")
        own, packed = await asyncio.to_thread(pack_part, self._plan, tensors)
        manifest, parts = join_parts(await asyncio.to_thread(self._peers.parts, own))
        self._senders = 1 + parts[-1].sender
        return manifest, Outgoing(0, parts, own.manifest, packed)

    def _partial_ok(self) -> bool | None:
        """Whether this version can go partial: True when every receiver took the base; None when one does not apply
        partial updates (or is new); False when one lacks the base (it missed it or failed it: a fallback)."""
        if not self.receivers or not all(self._partial.get(address) for address in self.receivers):
            return None
        return all(self._took.get(address) == self._delta.base_version for address in self.receivers)

    # -- the protocol's steps ----------------------------------------------------------------------

    async def _begin_round(
        self, manifest: Manifest, version: int, results: dict[str, ReceiverResult],
        forms: tuple[Outgoing, Outgoing] | None = None,
    ) -> tuple[list[str], Group | None, Outgoing | None]:
        """BeginUpdate to every receiver. If some fail, the others are told to abort and the round starts
        again on a new group without the failed ones (at most three rounds); if some need the whole version
        instead of a partial one, again with the whole version (forms: the partial and the whole one)."""
        members = list(self.receivers)
        outgoing = None if forms is None else forms[0]
        for _ in range(3):
            if not members:
                return [], None, outgoing
            group = self._transport.group_for(members)
            reused = group.transfer is not None
            try:
                errors, needs_full = await self._begin(group, manifest, version, outgoing)
            except _MixedGroup as mixed:
                await self._abort(members, version)
                self._transport.drop()
                why = (f"BeginUpdate: {', '.join(mixed.per_tensor)} receive one broadcast per tensor (an engine that "
                       "joins the group itself: SGLang), the others buckets; one group cannot carry both")
                for address in members:
                    results[address] = ReceiverResult(address, False, why)
                return [], None, outgoing
            if needs_full and not errors:
                log.info("version %d: %s lack base version %d: sending it whole", version, needs_full,
                         outgoing.base_version)
                await self._abort(members, version)
                self._transport.drop()
                self._delta.fell_back()
                outgoing = forms[1]
                continue
            if not errors:
                return members, group, outgoing
            await self._abort([m for m in members if m not in errors], version)
            self._transport.drop()
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
        return [], None, outgoing

    async def _begin(self, group: Group, manifest: Manifest, version: int, outgoing: Outgoing | None = None,
                     ) -> tuple[dict[str, grpc.RpcError], list[str]]:
        """BeginUpdate to the group's members, concurrently; the errors by address, and who needs the whole version."""
        specs, bucket_sizes = self._plan.wire(manifest)
        group_specs = await self._transport.member_specs(group)
        parts = [] if outgoing is None else [part.to_proto() for part in outgoing.parts]
        base_version = 0 if outgoing is None else outgoing.base_version

        async def one(address: str, spec: GroupSpec) -> weights_pb2.BeginUpdateResponse:
            senders = [sender_spec(spec, sender).to_proto() for sender in range(1, self._senders)]
            request = weights_pb2.BeginUpdateRequest(
                version=version, tensors=specs, bucket_sizes=bucket_sizes, group=spec.to_proto(),
                timeout_s=self.config.timeout_s, base_version=base_version, parts=parts, sender_groups=senders,
            )
            return await self._stub(address).BeginUpdate(request, timeout=self.config.control_timeout_s)

        replies = await asyncio.gather(
            *(one(address, spec) for address, spec in zip(group.members, group_specs, strict=True)),
            return_exceptions=True,
        )
        errors, per_tensor, needs_full = {}, {}, []
        for address, reply in zip(group.members, replies, strict=True):
            if isinstance(reply, grpc.RpcError):
                errors[address] = reply
            elif isinstance(reply, BaseException):
                raise reply
            else:
                per_tensor[address] = reply.tensor_broadcasts
                self._partial[address] = reply.partial_updates
                if reply.needs_full:
                    needs_full.append(address)
        if not errors and len(set(per_tensor.values())) > 1:
            raise _MixedGroup(sorted(a for a, flag in per_tensor.items() if flag))
        if per_tensor and not errors:
            group.tensor_broadcasts = next(iter(per_tensor.values()))
        return errors, needs_full

    async def _transfer_and_commit(
        self, group: Group, manifest: Manifest, tensors: Tensors, version: int,
        results: dict[str, ReceiverResult], report: PublishReport, outgoing: Outgoing | None = None,
    ) -> None:
        deadline = deadline_after(self.config.timeout_s)
        step = "rendezvous"
        started = time.perf_counter()
        pending: list[asyncio.Task] = []
        try:
            if self._peers is not None:  # every other sender starts this round: its group, its buckets
                await asyncio.to_thread(self._peers.assign, self._transport.spec(group, 0), version, deadline)
            if group.transfer is None:
                await self._transport.join(group, tensors)
            report.rendezvous_s = time.perf_counter() - started
            step = "transfer"
            started = time.perf_counter()
            # CommitUpdate travels with the buckets: a receiver answers once it holds them all and has switched,
            # so no round trip is left to make after the last byte.
            pending = [asyncio.create_task(self._commit(address, version, deadline)) for address in group.members]
            if outgoing is not None and not group.tensor_broadcasts:
                manifest, tensors = outgoing.manifest, outgoing.tensors
            await self._transport.send(group, manifest, tensors, deadline)
            report.transfer_s = time.perf_counter() - started
        except TransferError as exc:
            for address in group.members:
                results[address] = ReceiverResult(address, False, f"{step} failed: {exc}")
            self._transport.drop()
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
            self._transport.drop()

    async def _commit(self, address: str, version: int, deadline: float) -> ReceiverResult:
        wait_s = max(deadline - time.monotonic(), self.config.control_timeout_s)
        request = weights_pb2.CommitUpdateRequest(version=version, timeout_s=wait_s)
        try:
            reply = await self._stub(address).CommitUpdate(request, timeout=wait_s + self.config.control_timeout_s)
        except grpc.RpcError as exc:
            return ReceiverResult(address, False, f"CommitUpdate {_describe(exc)}")
        return ReceiverResult(address, True, version=reply.current_version, receive_s=reply.receive_s,
                              switch_s=reply.switch_s, pause_s=reply.pause_s)

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

    def _stub(self, address: str) -> weights_pb2_grpc.WeightSyncStub:
        if address not in self._stubs:
            channel = connect(address, self.config.client)
            self._channels.append(channel)
            self._channel_of[address] = channel
            self._stubs[address] = weights_pb2_grpc.WeightSyncStub(channel)
        return self._stubs[address]

