"""LoRA updates on the rollout side (docs/architecture.md, "Partial updates"; docs/lora.md): a trainer with
`model.lora` publishes the base once and then each version's adapters alone (trainer/broadcast/adapter.py), as
`<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r], B pre-scaled by alpha / r.

Unmerged (the native engine's lora.mode unmerged, rollout/model/lora.py): an update of adapters alone (every bucket
that moved holds an adapter: `adapter_only`) lands in place in the buffers the engine serves W from (W's bytes do
not change; the engine copies the adapters out at the switch) and the engine gets the adapters alone (`adapter_views`):
a new resident version, W untouched. A whole update hands the engine every tensor: W adopted, the adapters copied.

Merged (below, and every engine but the native one in unmerged mode):
the receiver keeps the staged base whole (it is the base the next partial update patches) and hands the engine, for
each adapted weight, W + B @ A computed in float32 into a copy of its bucket (W's dtype); every other weight is the
staged tensor itself. The engine then serves the adapter's version as plain weights. The copy and the matmuls run on
the receiving thread, before the switch: the engine's pause is an adoption, as for a whole update.
"""

from collections.abc import Sequence

import torch

from services.weights import Manifest, unpack_bucket
from services.weights.delta import UNCHANGED, BucketPart

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def is_adapter(name: str) -> bool:
    return name.endswith((LORA_A, LORA_B))


def adapted_weight(name: str) -> str:
    """The base weight an adapter tensor adapts: `m.lora_A.weight` -> `m.weight`."""
    return name.removesuffix(LORA_A if name.endswith(LORA_A) else LORA_B) + ".weight"


@torch.no_grad()
def merged_weights(manifest: Manifest, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's weights of an update staged in `buffers`: each bucket holding an adapted W is copied, W + B @ A
    written into the copy in place (so merged projections keep lying back to back: the engine adopts them without a
    copy while it pauses), every other tensor is the staged one; the adapters themselves are left out."""
    slots = {slot.name: slot for slot in manifest.slots}
    adapted = {adapted_weight(name) for name in slots if name.endswith(LORA_A)}
    copied = {slots[weight].bucket for weight in adapted}
    views: dict[str, torch.Tensor] = {}
    for index, bucket in enumerate(buffers):
        views.update(unpack_bucket(manifest, index, bucket.clone() if index in copied else bucket))
    for weight in adapted:
        module = weight.removesuffix(".weight")
        base = views[weight]
        base.copy_(torch.addmm(base.float(), views[module + LORA_B].float(), views[module + LORA_A].float()))
    return {name: tensor for name, tensor in views.items() if not is_adapter(name)}


def adapter_only(manifest: Manifest, parts: Sequence[BucketPart]) -> bool:
    """Whether a partial update changes adapters alone: it carries some, and every bucket it sends bytes for holds
    one (a LoRA trainer's base never changes; a bucket shared by the base's last tensors and the first adapters is
    sent with those base bytes as they were)."""
    holding = {slot.bucket for slot in manifest.slots if is_adapter(slot.name)}
    return bool(holding) and bool(parts) and all(part.encoding == UNCHANGED or part.bucket in holding for part in parts)


def adapter_views(manifest: Manifest, buffers: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of an update staged in `buffers`, as views (the engine copies them)."""
    views: dict[str, torch.Tensor] = {}
    for index in sorted({slot.bucket for slot in manifest.slots if is_adapter(slot.name)}):
        views.update((name, t) for name, t in unpack_bucket(manifest, index, buffers[index]).items() if is_adapter(name))
    return views
