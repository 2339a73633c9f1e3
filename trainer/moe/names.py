"""Expert weights under two sets of names: transformers' (5.25) fused modules hold all of a layer's experts as one
tensor each (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first; `mlp.experts.down_proj` [E, H, I]), while
checkpoints on the Hub (and transformers' save_pretrained) name each expert's projections
(`mlp.experts.3.gate_proj.weight` [I, H], `up_proj.weight` [I, H], `down_proj.weight` [H, I]). Exports write the
per-expert names (every engine loads them: vLLM, SGLang, the native one); the sharded loader reads them into the fused
tensors (trainer/parallel/loading.py).
"""

import torch

FUSED = ("experts.gate_up_proj", "experts.down_proj")


def is_fused_experts(name: str) -> bool:
    return name.endswith(FUSED)


def expert_parts(name: str, experts: int) -> list[list[str]]:
    """The per-expert names whose tensors make the fused tensor `name`: for each expert, [gate, up] (gate_up_proj)
    or [down] (down_proj)."""
    prefix, projection = name.rsplit(".", 1)
    kinds = ("gate_proj", "up_proj") if projection == "gate_up_proj" else ("down_proj",)
    return [[f"{prefix}.{expert}.{kind}.weight" for kind in kinds] for expert in range(experts)]


def fuse(parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """The fused tensor of `expert_parts`' tensors: each expert's parts stacked by rows, the experts along dim 0."""
    return torch.stack([torch.cat(expert) for expert in parts])


def per_expert_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` with every fused experts tensor split into its per-expert names (views; the rest as it is)."""
    out = {}
    for name, tensor in tensors.items():
        if not is_fused_experts(name):
            out[name] = tensor
            continue
        for names, expert in zip(expert_parts(name, tensor.shape[0]), tensor, strict=True):
            out.update(zip(names, expert.chunk(len(names)), strict=True))
    return out
