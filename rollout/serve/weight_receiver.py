"""The rollout worker's side of weight sync: the relayrl.weights.v1.WeightSync servicer.

BeginUpdate validates the manifest against the engine's parameters, then a background thread joins (or reuses) the
update group and receives every bucket into staging buffers (on the engine's GPU when the group was formed as CUDA
IPC: services/weights/cuda_ipc.py). CommitUpdate waits for that thread (with its timeout) and hands views of the
staged tensors to `AsyncEngine.update_weights`, which switches between two decode steps and says how long the engine
generated nothing (pause_s). On any failure the worker keeps serving its old version and the call says why; nothing
here can block the engine or the trainer past a deadline.

The engine adopts the staged tensors (serves them without copying), so staging is double-buffered: one set holds
the served version, the other receives the next. An engine that copies them into its own parameters (`adopts_weights`
False: CUDA graphs, whose captured parameters keep their storage) leaves them free once the switch returns.

A partial update (base_version set: a delta, or a LoRA adapter; docs/architecture.md) lands in staging as the base
version's bytes patched by its parts (services/weights/delta.py), checksums verified. Its base is the version the
receiver's own buffers hold (the served set, or the one set of an engine that copies); a worker that holds any other
(it missed a version, restarted or joined) takes nothing and answers needs_full: the trainer sends the whole version.
An update that carries LoRA adapters (rollout/serve/adapter_merge.py) goes to an engine that serves them unmerged
(`serves_adapters_unmerged`: the native engine's lora.mode unmerged) as they are: an update of adapters alone lands in
place in the buffers the engine serves W from (no copy of the base, no swap) and the engine makes it a resident
version; to any other it is merged once received: W + B @ A for each adapted weight, the staged base kept whole.
What an update must match, and the engine interface: rollout/serve/weight_layout.py.

Several senders (pipeline stages publishing their own layers: BeginUpdate's sender_groups) each have a group with
this worker, joined in sender order, each one's receives posted as soon as it forms: the version is staged once every
part has arrived, and a part missing at the deadline fails it naming its sender (services/weights/delta.py).

An engine that joins the trainer's group itself (`receives_from_group`, rollout/engines/base.py: SGLang) gets no
staging: BeginUpdate answers `tensor_broadcasts` (the trainer sends one broadcast per tensor over a named group) and
has the engine join the group once; CommitUpdate, sent only as the broadcasts start, has it receive into its own
memory, then tags the following tokens with the new version. SGLang's scheduler blocks while it receives, so a
publish given up before then leaves it serving.
"""

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
import torch

from protos import weights_pb2, weights_pb2_grpc
from protos.codec import CodecError
from rollout.serve.adapter_merge import adapter_only, adapter_views, is_adapter, merged_weights
from rollout.serve.weight_layout import Layout, Staging, UpdatableEngine, check_layout
from services.runtime import Sparse
from services.weights import (
    GroupSpec,
    Manifest,
    Transfer,
    TransferError,
    allocate_staging,
    deadline_after,
    make_group,
    receive_buckets,
    transfer_device,
)
from services.weights.delta import BucketPart, parse_parts, receive_parts

log = logging.getLogger(__name__)

@dataclass
class _Update:
    """One version being received."""

    version: int
    manifest: Manifest
    spec: GroupSpec  # sender 0's group
    deadline: float
    staging: Staging | None  # None: the engine receives the tensors itself
    parts: tuple[BucketPart, ...] = ()  # how each bucket travels (empty: every bucket whole, unchecked)
    base: list[torch.Tensor] | None = None  # the buffers a partial update patches (None: staging itself)
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: Future = field(default_factory=Future)  # result: seconds the receive took
    joining: asyncio.Future | None = None  # the engine joining the group, when it receives itself: its error or None
    receiving: bool = False  # the engine was asked to receive (at the first CommitUpdate)
    engine_receive_s: float = 0.0  # how long the engine's own receive blocked it (it generates nothing meanwhile)
    weights: dict[str, torch.Tensor] | None = None  # what the engine switches to, when not the staged views (LoRA)
    senders: tuple[GroupSpec, ...] = ()  # every sender's group, sender 0's first (several: sender_groups)
    in_place: bool = False  # adapters alone, received into the buffers the engine serves (LoRA unmerged)


class WeightReceiver(weights_pb2_grpc.WeightSyncServicer):
    """Receives weight updates for `engine`. `layout` (name -> (shape, dtype)) is what updates must
    match; by default the engine's parameters. `device`: where NCCL-backed updates land, by default the
    engine's (gloo lands on the CPU)."""

    def __init__(self, engine: UpdatableEngine, layout: Layout | None = None, device: torch.device | str | None = None):
        self.engine = engine
        self.layout = layout if layout is not None else engine.parameter_layout()
        self.device = torch.device(device) if device is not None else engine.device
        self._pending: _Update | None = None
        self._staging: Staging | None = None  # free for the next update
        self._served: Staging | None = None  # adopted by the engine: never written
        self._checked: tuple[weights_pb2.BeginUpdateRequest, Manifest] | None = None  # the last valid manifest
        self._groups: tuple[Transfer, ...] = ()  # the groups of the last update's senders, kept (one unless several)
        self._engine_receives = bool(getattr(engine, "receives_from_group", False))
        self._unmerged = bool(getattr(engine, "serves_adapters_unmerged", False))
        self._engine_group: GroupSpec | None = None  # the group the engine joined, when it receives itself
        self._group_lock = threading.Lock()
        self._switch_lock = asyncio.Lock()
        self._log_level = Sparse()
        self._held: tuple[int, Manifest] | None = None  # the version (and layout) whole in this receiver's buffers

    async def BeginUpdate(self, request, context):
        manifest = self._manifest_of(request)
        senders = _sender_groups(request)
        spec = senders[0]
        parts = parse_parts(manifest, request.parts, len(senders))
        if not request.timeout_s > 0:
            raise CodecError(f"timeout_s: must be > 0, got {request.timeout_s}")
        device = None
        if len(senders) > 1 and self._engine_receives:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker's engine receives from the group "
                                "itself (one broadcast per tensor): it takes a version from one sender only")
        if not self._engine_receives:
            try:
                device = transfer_device(spec.backend, self.device)
            except TransferError as exc:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this worker cannot take the update: {exc}")
            held = self._groups[0] if self._groups else None
            if spec.existing and held is not None and self._holds(spec):
                device = held.device  # a group formed as CUDA IPC stages on this GPU, whatever backend it was asked as
        async with self._switch_lock:
            current = self.engine.weight_version
            if request.version <= current:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"version {request.version} is not newer than the served version {current}")
            if request.base_version and not self._holds_base(request.base_version, manifest, parts):
                return weights_pb2.BeginUpdateResponse(current_version=current, needs_full=True,
                                                       partial_updates=not self._engine_receives)
            self._cancel_pending()
            lost = [s.group_name for s in senders if s.existing and not self._holds(s)]
            if lost:
                await context.abort(grpc.StatusCode.ABORTED,
                                    f"group(s) {lost} not held here (restarted?): form new groups")
            in_place = (bool(request.base_version) and self._unmerged and self._served is not None
                        and adapter_only(manifest, parts))
            if in_place:  # W's bytes stay as they are: the adapters' buckets are patched where they lie
                staging = Staging(manifest, self._served.buffers)
            else:
                staging = None if self._engine_receives else self._take_staging(manifest, device)
            update = _Update(request.version, manifest, spec, deadline_after(request.timeout_s), staging, parts,
                             senders=senders, in_place=in_place)
            if request.base_version and self._served is not None and not in_place:
                update.base = self._served.buffers
            elif not self._adopts():
                self._held = None  # the one set of buffers is being overwritten
            update.done.set_running_or_notify_cancel()  # a waiter that gives up must not cancel it
            self._pending = update
            log.info("receiving weight version %d on group %s (rank %d of %d, %d bytes)", update.version,
                     spec.group_name, spec.rank, spec.world_size, manifest.total_bytes)
            if self._engine_receives:
                update.joining = asyncio.ensure_future(self._join_in_engine(update))
            else:
                threading.Thread(target=self._receive, args=(update,), name=f"weights-v{update.version}",
                                 daemon=True).start()
        return weights_pb2.BeginUpdateResponse(current_version=current, tensor_broadcasts=self._engine_receives,
                                               partial_updates=not self._engine_receives)

    async def CommitUpdate(self, request, context):
        update = self._pending
        current = self.engine.weight_version
        if update is None or update.version != request.version:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no update to version {request.version} in progress; serving version {current}")
        wait_s = request.timeout_s if request.timeout_s > 0 else max(update.deadline - time.monotonic(), 0.0)
        if update.joining is not None and not update.receiving:  # the trainer's broadcasts are starting
            update.receiving = True
            asyncio.ensure_future(self._receive_in_engine(update))
        try:
            receive_s = await asyncio.wait_for(asyncio.wrap_future(update.done), wait_s)
        except TimeoutError:
            self._cancel(update)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"version {update.version}: buckets not all received after {wait_s:.1f}s; "
                                f"still serving version {current}")
        except TransferError as exc:
            self._cancel(update)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"version {update.version}: transfer failed ({exc}); still serving version {current}")
        async with self._switch_lock:
            if self._pending is not update:
                await context.abort(grpc.StatusCode.ABORTED,
                                    f"version {update.version} was aborted or superseded; serving version "
                                    f"{self.engine.weight_version}")
            if update.staging is None:
                switch_s = await self.engine.serve_received(update.version)
                pause_s = update.engine_receive_s + switch_s
                self._pending = None
            else:
                weights = update.weights if update.weights is not None else update.staging.views()
                switch_s = await self.engine.update_weights(weights, update.version, adopt=True)
                pause_s = self.engine.last_pause_s
                self._pending = None
                self._held = (update.version, update.manifest)
                if update.in_place:
                    pass  # the engine serves W from the same buffers, the adapters from its own copies
                elif self._adopts():
                    # The engine serves this update's buffers now and none of the replaced version's.
                    self._staging, self._served = self._served, update.staging
                else:  # copied: the buffers are free for the next update
                    self._staging, self._served = update.staging, None
        log.log(self._log_level.level(), "switched to weight version %d (receive %.3fs, switch %.3fs, paused %.3fs)",
                update.version, receive_s, switch_s, pause_s)
        return weights_pb2.CommitUpdateResponse(current_version=self.engine.weight_version, receive_s=receive_s,
                                                switch_s=switch_s, pause_s=pause_s)

    async def AbortUpdate(self, request, context):
        async with self._switch_lock:
            update = self._pending
            if update is not None and (request.version in (0, update.version)):
                self._cancel(update)
        return weights_pb2.AbortUpdateResponse(current_version=self.engine.weight_version)

    # -- the background receive ---------------------------------------------------------------------

    def _receive(self, update: _Update) -> None:
        started = time.monotonic()
        try:
            group = self._join(update)
            if update.staging.buffers[0].device != group.device:  # formed as CUDA IPC: the trainer is on this GPU
                update.staging = Staging(update.manifest, allocate_staging(update.manifest, group.device))
            if len(update.senders) > 1:  # each sender's parts on its own group, joined in turn
                receive_parts(lambda sender: group if sender == 0 else self._join(update, sender), update.manifest,
                              update.parts, update.deadline, update.staging.buffers, update.base, update.cancelled)
            elif update.parts:
                receive_parts(group, update.manifest, update.parts, update.deadline, update.staging.buffers,
                              update.base, update.cancelled)
            else:
                receive_buckets(group, update.manifest, update.deadline, update.staging.buffers, update.cancelled)
            adapted = any(is_adapter(slot.name) for slot in update.manifest.slots)
            if adapted and not self._unmerged:  # LoRA merged: W + B @ A, the base kept whole
                update.weights = merged_weights(update.manifest, update.staging.buffers)
            elif adapted and update.parts and adapter_only(update.manifest, update.parts):  # a new adapter version
                update.weights = adapter_views(update.manifest, update.staging.buffers)
        except TransferError as exc:
            if update.in_place:
                self._held = None  # the served buffers' adapter bytes are no version's now: the next update is whole
            self._drop_groups(update)
            update.done.set_exception(exc)
            log.warning("receiving weight version %d failed: %s", update.version, exc)
            return
        update.done.set_result(time.monotonic() - started)

    async def _join_in_engine(self, update: _Update) -> Exception | None:
        """The engine joins the update's group unless it holds it, by the deadline; the error, if it failed."""
        spec = update.spec
        try:
            if not self._holds(spec):
                await self._leave_engine_group()
                await asyncio.wait_for(self.engine.join_weight_group(spec), update.deadline - time.monotonic())
                self._engine_group = spec
        except (TimeoutError, RuntimeError) as exc:
            await self._leave_engine_group()
            return exc
        return None

    async def _receive_in_engine(self, update: _Update) -> None:
        """Once joined, the engine receives every tensor, by the deadline. A receive cut short by the deadline may
        still be running inside the engine: its group is left."""
        started = time.monotonic()
        error = await update.joining
        if error is None:
            try:
                receiving = time.monotonic()
                await asyncio.wait_for(self.engine.receive_weights(update.manifest, update.spec.group_name),
                                       update.deadline - time.monotonic())
                update.engine_receive_s = time.monotonic() - receiving
            except (TimeoutError, RuntimeError) as exc:
                await self._leave_engine_group()
                error = exc
        if error is not None:
            failure = TransferError(f"the engine's receive failed: {error or 'deadline passed'}")
            update.done.set_exception(failure)
            log.warning("receiving weight version %d failed: %s", update.version, failure)
            return
        update.done.set_result(time.monotonic() - started)

    async def _leave_engine_group(self) -> None:
        spec, self._engine_group = self._engine_group, None
        if spec is not None:
            await self.engine.leave_weight_group(spec.group_name)

    def _join(self, update: _Update, sender: int = 0) -> Transfer:
        """The group of `sender` of `update`, held or formed (by the deadline). A new group of sender 0 replaces
        every group held; a sender's after it joins them."""
        spec = update.senders[sender] if update.senders else update.spec
        with self._group_lock:
            held = self._held_group(spec)
            if held is not None:
                return held
            old = self._groups if sender == 0 else ()
            if sender == 0:
                self._groups = ()
        for group in old:
            group.close()
        left = update.deadline - time.monotonic()
        if left <= 0:
            raise TransferError(f"version {update.version}: deadline passed before joining group {spec.group_name}")
        group = make_group(spec, left, device=self.device)
        with self._group_lock:
            # An update aborted meanwhile must not install its group over a newer one.
            if not update.cancelled.is_set():
                old, self._groups = (self._groups, (group,)) if sender == 0 else ((), (*self._groups, group))
                for stale in old:
                    stale.close()
                return group
        group.close()
        raise TransferError(f"version {update.version}: aborted while joining the group")

    def _adopts(self) -> bool:
        return getattr(self.engine, "adopts_weights", True)

    def _holds_base(self, base_version: int, manifest: Manifest, parts: tuple[BucketPart, ...]) -> bool:
        """Whether a partial update on `base_version` can be applied here: this receiver's buffers hold that version
        whole, in this layout, and the engine serves it."""
        return (bool(parts) and not self._engine_receives and self._held is not None
                and self._held[0] == base_version == self.engine.weight_version and self._held[1] == manifest)

    def _holds(self, spec: GroupSpec) -> bool:
        if self._engine_receives:
            return self._engine_group is not None and _same_group(self._engine_group, spec)
        return self._held_group(spec) is not None

    def _held_group(self, spec: GroupSpec) -> Transfer | None:
        return next((group for group in self._groups if _same_group(group.spec, spec)), None)

    def _drop_groups(self, update: _Update) -> None:
        """Drop the groups held, if they are `update`'s (a failed or cut-short receive leaves them unusable)."""
        names = {spec.group_name for spec in update.senders or (update.spec,)}
        with self._group_lock:
            if not any(group.spec.group_name in names for group in self._groups):
                return
            groups, self._groups = self._groups, ()
        for group in groups:
            group.close()

    def _cancel(self, update: _Update) -> None:
        """Forget `update`; if it was still receiving, its group is mid-collective and unusable."""
        update.cancelled.set()
        if update.in_place:
            self._held = None  # its bytes may be in the served buffers already
        if not update.done.done():
            if self._engine_receives:
                asyncio.ensure_future(self._leave_engine_group())
            else:
                self._drop_groups(update)
        if self._pending is update:
            self._pending = None

    def _cancel_pending(self) -> None:
        if self._pending is not None:
            self._cancel(self._pending)

    def _manifest_of(self, request: weights_pb2.BeginUpdateRequest) -> Manifest:
        """The request's manifest, checked against the layout; an update laid out like the last one
        (the usual case: a trainer publishes the same tensors every time) reuses that check."""
        checked = self._checked
        if checked is not None and request.bucket_sizes == checked[0].bucket_sizes and request.tensors == checked[0].tensors:
            return checked[1]
        manifest = Manifest.from_proto(request.tensors, request.bucket_sizes)
        # The engine casts what it is handed; adapters are merged here, so not for an engine that receives itself.
        check_layout(manifest, self.layout, widen=not self._engine_receives, adapters=not self._engine_receives,
                     adaptable=getattr(self.engine, "adapter_problem", None) if self._unmerged else None)
        self._checked = (request, manifest)
        return manifest

    def _take_staging(self, manifest: Manifest, device: torch.device) -> Staging:
        staging, self._staging = self._staging, None
        if (staging is None or [t.numel() for t in staging.buffers] != list(manifest.bucket_sizes)
                or any(t.device != device for t in staging.buffers)):
            return Staging(manifest, allocate_staging(manifest, device))
        if staging.manifest is manifest or staging.manifest == manifest:
            return staging
        return Staging(manifest, staging.buffers)


def _same_group(held: GroupSpec, spec: GroupSpec) -> bool:
    return held.group_name == spec.group_name and held.rank == spec.rank and held.world_size == spec.world_size


def _sender_groups(request: weights_pb2.BeginUpdateRequest) -> tuple[GroupSpec, ...]:
    """Every sender's group (sender 0's: `group`), checked: one backend, this worker's rank and the world size alike
    in each, names distinct; several senders only over gloo (CodecError)."""
    senders = (GroupSpec.from_proto(request.group), *(GroupSpec.from_proto(g) for g in request.sender_groups))
    first = senders[0]
    for index, spec in enumerate(senders[1:], 1):
        if (spec.backend, spec.rank, spec.world_size) != (first.backend, first.rank, first.world_size):
            raise CodecError(f"sender_groups[{index - 1}]: backend {spec.backend}, rank {spec.rank} of "
                             f"{spec.world_size}; group says {first.backend}, rank {first.rank} of {first.world_size}")
    if len({spec.group_name for spec in senders}) != len(senders):
        raise CodecError("sender_groups: every sender's group needs a name of its own")
    if len(senders) > 1 and first.backend != "gloo":
        raise CodecError(f"sender_groups: several senders over {first.backend!r} are not implemented (gloo only)")
    return senders
