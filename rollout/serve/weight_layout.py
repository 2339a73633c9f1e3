"""What a weight update must match on the rollout side: the engine's parameter layout (check_layout), the engine
interface the receiver drives (UpdatableEngine), and the buffers an update lands in (Staging). A LoRA update's
adapters (`<module>.lora_A.weight`, `<module>.lora_B.weight`) need no parameter of their own: each must fit the base
weight it adapts (rollout/serve/adapter_merge.py folds them in)."""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

from protos.codec import CodecError
from rollout.serve.adapter_merge import LORA_A, LORA_B, adapted_weight, is_adapter
from services.weights import Manifest, unpack_buckets

Layout = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


class UpdatableEngine(Protocol):
    """What the receiver needs from the engine (every engine of rollout/engines/base.py provides it). An engine that
    serves LoRA adapters unmerged also has `serves_adapters_unmerged` (True) and `adapter_problem(weight)`
    (rollout/engine/llm_engine.py); the receiver then hands it adapters as they are."""

    @property
    def weight_version(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Where the engine's parameters live (with the CUDA index): staging and NCCL groups go there."""
        ...

    def parameter_layout(self) -> Layout: ...

    async def update_weights(self, weights: dict[str, torch.Tensor], version: int, adopt: bool = False) -> float:
        """Switch to `weights` as `version`. With `adopt` the engine may serve the tensors themselves: the
        receiver leaves them untouched until a later update has replaced them."""
        ...

    @property
    def last_pause_s(self) -> float:
        """Seconds the last update_weights kept the engine from generating (rollout/engines/base.py)."""
        ...


@dataclass
class Staging:
    """The buffers an update lands in (one per bucket, see allocate_staging) and the named views into them."""

    manifest: Manifest
    buffers: list[torch.Tensor]
    _views: dict[str, torch.Tensor] | None = None

    def views(self) -> dict[str, torch.Tensor]:
        """name -> tensor over the staged bytes (no copy); made once per buffers and manifest."""
        if self._views is None:
            self._views = unpack_buckets(self.manifest, self.buffers)
        return self._views


def check_layout(manifest: Manifest, layout: Layout, widen: bool = False, adapters: bool = False,
                 adaptable: Callable[[str], str | None] | None = None) -> None:
    """Every tensor of the update must be a parameter of the engine with the same shape and dtype,
    and every parameter must be in the update (a partial update would mix two versions). With `widen`, a float32
    tensor may update a bfloat16 / float16 parameter: the engine casts it at the switch (a float32 trainer publishing
    to an engine in bfloat16, the default on a GPU; its float32 LM head then comes from the published tensor). With
    `adapters`, LoRA pairs may come too: A [r, in] and B [out, r] of a parameter [out, in] (merged on receipt, or served
unmerged: then `adaptable(weight)` says why a weight's adapter cannot be, None when it can)."""
    slots = {slot.name: slot for slot in manifest.slots}
    for slot in manifest.slots:
        if adapters and is_adapter(slot.name):
            _check_adapter(slot.name, slots, layout)
            if adaptable is not None and (why := adaptable(adapted_weight(slot.name))) is not None:
                raise CodecError(f"tensor {slot.name!r}: {why}")
            continue
        if slot.name not in layout and is_adapter(slot.name):
            raise CodecError(f"tensor {slot.name!r}: the model has no such parameter, and this worker takes no LoRA "
                             "adapters: its engine receives weights from the trainer's group itself (SGLang), so "
                             "they cannot be merged here; serve the policy with engine.lora.mode unmerged")
        if slot.name not in layout:
            raise CodecError(f"tensor {slot.name!r}: the model has no such parameter")
        shape, dtype = layout[slot.name]
        cast = widen and slot.dtype == torch.float32 and dtype in (torch.bfloat16, torch.float16)
        if tuple(shape) != slot.shape or (dtype != slot.dtype and not cast):
            raise CodecError(
                f"tensor {slot.name!r}: the update has {list(slot.shape)} {slot.dtype}, the model "
                f"{list(shape)} {dtype}"
            )
    missing = sorted(set(layout) - {slot.name for slot in manifest.slots})
    if missing:
        raise CodecError(f"tensors: the update lacks {len(missing)} parameters, e.g. {missing[0]!r}")


def _check_adapter(name: str, slots: Mapping, layout: Layout) -> None:
    weight = adapted_weight(name)
    if weight not in layout or len(layout[weight][0]) != 2:
        raise CodecError(f"tensor {name!r}: an adapter of {weight!r}, which is no matrix parameter of the model")
    a, b = (slots.get(weight.removesuffix(".weight") + suffix) for suffix in (LORA_A, LORA_B))
    if a is None or b is None:
        raise CodecError(f"tensor {name!r}: an adapter needs both lora_A and lora_B of {weight!r}")
    out_features, in_features = layout[weight][0]
    if (len(a.shape) != 2 or len(b.shape) != 2 or a.shape[1] != in_features or b.shape[0] != out_features
            or a.shape[0] != b.shape[1] or not a.dtype.is_floating_point or not b.dtype.is_floating_point):
        raise CodecError(f"adapter of {weight!r} {list(layout[weight][0])}: lora_A {list(a.shape)} {a.dtype} and "
                         f"lora_B {list(b.shape)} {b.dtype} do not fit (A [r, in], B [out, r], floating)")
