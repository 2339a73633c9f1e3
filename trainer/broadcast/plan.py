"""Which tensors a publish sends and how they lie in buckets: the manifest, and parameters bound to its layout.

Pure bookkeeping over tensors; nothing here talks to a receiver or a process group (transport.py does).
"""

from collections.abc import Mapping

import torch

from protos import weights_pb2
from services.weights import (
    Manifest,
    TensorSlot,
    allocate_staging,
    bind_to_buckets,
    merge_order,
    plan_buckets,
    unpack_buckets,
)
from services.weights.manifest import ALIGN_BYTES
from trainer.broadcast.config import BroadcastConfig
from trainer.broadcast.gather import ShardedWeights, publish_dtype
from trainer.lora import is_adapter


class BroadcastPlan:
    """The tensors of each publish (detached, cast, each sent once) and their bucket layout, kept while the
    names, shapes and dtypes stay the same; or, once bound, the one-bucket layout the parameters live in."""

    def __init__(self, config: BroadcastConfig):
        self.config = config
        self._bucket_bytes = int(config.bucket_mb * (1 << 20))
        solo_mb = config.bucket_mb if config.solo_mb is None else config.solo_mb
        self._solo_bytes = int(solo_mb * (1 << 20))
        self._manifest: tuple[tuple, Manifest] | None = None
        self._wire: tuple[Manifest, list[weights_pb2.TensorSpec], list[int]] | None = None  # its BeginUpdate fields
        self._bound: tuple[Manifest, list[torch.Tensor]] | None = None  # bind(): the layout, the parameters' buffers
        self._snapshot: list[torch.Tensor] | None = None  # snapshot(): a second set of buffers in that layout

    def prepare(self, named_tensors: Mapping[str, torch.Tensor] | ShardedWeights
                ) -> dict[str, torch.Tensor] | ShardedWeights:
        """Detach, cast if configured, and send a tensor seen under two names once, under its first name:
        a tied model's state dict holds the embedding again as lm_head.weight, which the rollout engine
        does not count as a parameter of its own. ShardedWeights do that themselves as they gather."""
        cast = publish_dtype(self.config.dtype)
        if isinstance(named_tensors, ShardedWeights):
            if named_tensors.dtype != cast:
                raise ValueError(f"sharded weights gathered as {named_tensors.dtype}, the publish casts to {cast}: "
                                 "every rank must gather the bytes that are sent")
            return named_tensors
        prepared, seen = {}, set()
        for name, tensor in named_tensors.items():
            tensor = tensor.detach()
            view = (tensor.device, tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
            if tensor.numel() and view in seen:
                continue
            seen.add(view)
            prepared[name] = tensor.to(cast) if cast is not None and tensor.is_floating_point() else tensor
        return prepared

    def manifest(self, tensors: Mapping[str, torch.Tensor] | ShardedWeights) -> Manifest:
        """The bucket layout (in merge order: receivers adopt the staged bytes without a copy), recomputed
        only when names, shapes or dtypes change."""
        if isinstance(tensors, ShardedWeights):
            key = tuple(tensors.layout())
        else:
            key = tuple((name, tuple(t.shape), t.dtype) for name, t in tensors.items())
        if self._manifest is None or self._manifest[0] != key:
            group = is_adapter if self.config.adapter else None  # adapters in buckets of their own: adapter.py
            self._manifest = (key, plan_buckets(merge_order(key), self._bucket_bytes, self._solo_bytes, group))
        return self._manifest[1]

    def wire(self, manifest: Manifest) -> tuple[list[weights_pb2.TensorSpec], list[int]]:
        """The manifest's fields of a BeginUpdateRequest (tensors, bucket_sizes), kept while it is the same."""
        if self._wire is None or self._wire[0] is not manifest:
            self._wire = (manifest, *manifest.to_proto())
        return self._wire[1], self._wire[2]

    def bind(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """WeightBroadcaster.bind: lay `parameters` out as one bucket, in one buffer, and plan that layout."""
        if self.config.dtype is not None:
            raise ValueError("bind: publishes cast the tensors to config.dtype, so they never send from the parameters")
        key = tuple((name, tuple(t.shape), t.dtype) for name, t in self.prepare(parameters).items())
        whole = sum(TensorSlot(name, shape, dtype, 0, 0).nbytes for name, shape, dtype in key) + ALIGN_BYTES * len(key)
        self._manifest = (key, plan_buckets(merge_order(key), whole, solo_bytes=whole + 1))
        self._bound = (self._manifest[1], bind_to_buckets(parameters, self._manifest[1]))
        self._snapshot = None

    def snapshot(self) -> dict[str, torch.Tensor]:
        """WeightBroadcaster.snapshot: the bound parameters copied into a second buffer of their layout."""
        if self._bound is None:
            raise RuntimeError("snapshot: bind() the parameters first")
        manifest, buffers = self._bound
        if self._snapshot is None:
            self._snapshot = allocate_staging(manifest, buffers[0].device)
        with torch.no_grad():
            for source, copy in zip(buffers, self._snapshot, strict=True):
                copy.copy_(source)
        return unpack_buckets(manifest, self._snapshot)
