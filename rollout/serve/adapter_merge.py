"""LoRA updates on the rollout side, merged (docs/architecture.md, "Partial updates"): a trainer with `model.lora`
publishes the base once and then each version's adapters alone (trainer/broadcast/adapter.py), as
`<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r], B pre-scaled by alpha / r.

The receiver keeps the staged base whole (it is the base the next partial update patches) and hands the engine, for
each adapted weight, W + B @ A computed in float32 into a new tensor of W's dtype; every other weight is the staged
tensor itself. The engine then serves the adapter's version as plain weights.
"""

from collections.abc import Mapping

import torch

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"


def is_adapter(name: str) -> bool:
    return name.endswith((LORA_A, LORA_B))


def adapted_weight(name: str) -> str:
    """The base weight an adapter tensor adapts: `m.lora_A.weight` -> `m.weight`."""
    return name.removesuffix(LORA_A if name.endswith(LORA_A) else LORA_B) + ".weight"


@torch.no_grad()
def merged_weights(views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The engine's weights of an update: each adapted W as W + B @ A (new tensors), the rest as they are."""
    weights = {name: tensor for name, tensor in views.items() if not is_adapter(name)}
    for name, a in views.items():
        if name.endswith(LORA_A):
            weight = adapted_weight(name)
            b = views[name.removesuffix(LORA_A) + LORA_B]
            base = weights[weight]
            weights[weight] = torch.addmm(base.float(), b.float(), a.float()).to(base.dtype)
    return weights
