"""LoRA: low-rank adapters on the policy's linear layers (`model.lora`), peft's layout written out here.

The layer is the small one peft builds, written out with peft's names (it was written before peft was a dependency;
peft, now a dev dependency and the `lora` extra, loads what export writes, tested; moving onto peft's own layers is
left for later): a targeted `q_proj` becomes `q_proj.base_layer` (the frozen
nn.Linear) plus `q_proj.lora_A` [rank, in] and `q_proj.lora_B` [out, rank], and computes

    y = base_layer(x) + scale * lora_B(lora_A(dropout(x))),  scale = alpha / rank

with A drawn as peft draws it (kaiming-uniform, a=sqrt(5)) from a generator seeded per module, so every process of
a run (one or many ranks, any sharding) starts from the same adapter, and B zero (the adapter starts as a no-op).
Dropout applies in forwards with gradients only: the trainer's forward-only passes (proximal and reference
logprobs) are exact. `adapter_disabled` switches every adapter off: the base model, i.e. the reference policy.

Hugging Face names: `hf_base_names` maps `x.base_layer.weight` back to `x.weight` (loading, export); `merged_state`
folds W + scale * B @ A into the base (the merged export and full publishes); `adapter_state` is the adapter under
PEFT's saved names.
"""

import contextlib
import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ALL_LINEAR = "all-linear"
BASE, LORA_A, LORA_B = "base_layer", "lora_A", "lora_B"


class LoraLinear(nn.Module):
    """A frozen nn.Linear plus a trainable low-rank update (peft's names: base_layer, lora_A, lora_B)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        kwargs = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **kwargs)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **kwargs)
        self.scale = alpha / rank
        self.dropout = dropout
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        if not self.enabled:
            return y
        if self.dropout and torch.is_grad_enabled():
            x = F.dropout(x, self.dropout)
        return y + self.lora_B(self.lora_A(x)) * self.scale


def apply_lora(lm: nn.Module, rank: int, alpha: float, dropout: float, target_modules: list[str] | str) -> list[str]:
    """Wrap the targeted linear layers of `lm`'s decoder layers in place; the wrapped modules' names (sorted).

    `target_modules`: leaf names (q_proj, v_proj, ...) or "all-linear" (every nn.Linear inside the decoder layers;
    the LM head and embeddings never). ValueError when a named target matches nothing."""
    targets = None if target_modules == ALL_LINEAR else set(target_modules)
    wrapped, seen = [], set()
    layers = lm.base_model.layers
    for name, module in list(layers.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is not nn.Linear or (targets is not None and child_name not in targets):
                continue
            setattr(module, child_name, LoraLinear(child, rank, alpha, dropout))
            seen.add(child_name)
            wrapped.append(f"layers.{name}.{child_name}" if name else f"layers.{child_name}")
    if targets is not None and targets - seen:
        raise ValueError(f"model.lora.target_modules: no linear layer named {sorted(targets - seen)} in the decoder "
                         "layers")
    if not wrapped:
        raise ValueError("model.lora: no linear layer to adapt in the decoder layers")
    return sorted(wrapped)


def lora_modules(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    return [(name, module) for name, module in model.named_modules() if isinstance(module, LoraLinear)]


def has_lora(model: nn.Module) -> bool:
    return any(isinstance(module, LoraLinear) for module in model.modules())


def freeze_base(model: nn.Module, trainable_prefixes: tuple[str, ...] = ()) -> None:
    """Only the adapters (and parameters under `trainable_prefixes`, e.g. the value head) keep gradients."""
    for name, parameter in model.named_parameters():
        adapter = f".{LORA_A}." in name or f".{LORA_B}." in name
        parameter.requires_grad_(adapter or name.startswith(trainable_prefixes))


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """A as peft draws it, B zero; the same numbers in every process whatever the sharding (DTensor shards are cut
    from the whole tensor drawn on the CPU)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    for index, (_, module) in enumerate(lora_modules(model)):
        for parameter, draw in ((module.lora_A.weight, True), (module.lora_B.weight, False)):
            whole = torch.zeros(parameter.shape, dtype=parameter.dtype)
            if draw:
                nn.init.kaiming_uniform_(whole, a=math.sqrt(5), generator=torch.Generator().manual_seed(seed + index))
            if isinstance(parameter, DTensor):
                whole = distribute_tensor(whole.to(parameter.device), parameter.device_mesh, parameter.placements)
            parameter.copy_(whole)


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[nn.Module]:
    """Every adapter of `model` off inside the block (which gets `model`): the frozen base model."""
    modules = [module for _, module in lora_modules(model)]
    for module in modules:
        module.enabled = False
    try:
        yield model
    finally:
        for module in modules:
            module.enabled = True


def is_adapter(name: str) -> bool:
    return f".{LORA_A}." in name or f".{LORA_B}." in name


def hf_base_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's tensors of a LoRA-wrapped state dict under Hugging Face names (adapters left out)."""
    return {name.replace(f".{BASE}.", "."): t for name, t in state.items() if not is_adapter(name)}


def _pairs(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name -> (A, B) of every adapter in a state dict."""
    return {name.removesuffix(f".{LORA_A}.weight"): (t, state[name.replace(f".{LORA_A}.", f".{LORA_B}.")])
            for name, t in state.items() if name.endswith(f".{LORA_A}.weight")}


@torch.no_grad()
def merged_state(state: Mapping[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A LoRA-wrapped state dict as the plain model's: W + scale * B @ A under each base weight's name."""
    merged = hf_base_names(state)
    for module, (a, b) in _pairs(state).items():
        weight = f"{module}.weight"
        merged[weight] = (merged[weight].float() + scale * (b.float() @ a.float())).to(merged[weight].dtype)
    return merged


def adapter_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a state dict (Hugging Face module names, e.g. `model.layers.0.self_attn.q_proj.lora_A.weight`)."""
    return {name: t for name, t in state.items() if is_adapter(name)}


def adapter_scale(state: Mapping[str, torch.Tensor], alpha: float) -> float:
    """alpha / rank, the rank read off the adapters of `state`."""
    rank = next(t.shape[0] for name, t in state.items() if name.endswith(f".{LORA_A}.weight"))
    return alpha / rank


def save_peft_adapter(out_dir: Path, adapters: Mapping[str, torch.Tensor], *, alpha: float, dropout: float,
                      base_model: str) -> Path:
    """Write `adapters` (Hugging Face names) as a PEFT adapter folder: adapter_config.json and
    adapter_model.safetensors under PEFT's keys (`base_model.model.<name>`), loadable by peft's PeftModel."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {f"base_model.model.{name}": t.detach().cpu().contiguous() for name, t in adapters.items()}
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    rank = next(t.shape[0] for name, t in adapters.items() if name.endswith(f".{LORA_A}.weight"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
              "target_modules": sorted({name.split(".")[-3] for name in adapters}), "bias": "none",
              "fan_in_fan_out": False, "inference_mode": True, "base_model_name_or_path": base_model,
              "modules_to_save": None, "use_rslora": False, "use_dora": False}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def lora_settings(model: nn.Module) -> tuple[float, float] | None:
    """(alpha, dropout) of `model`'s adapters; None when it has none."""
    for _, module in lora_modules(model):
        return module.scale * module.lora_A.out_features, module.dropout
    return None


def write_adapter_export(out_dir: Path, hf_state: Mapping[str, torch.Tensor], alpha: float, dropout: float,
                         base_model: str) -> dict[str, torch.Tensor]:
    """An export of a LoRA policy: the PEFT adapter folder in `out_dir`/adapter; the merged weights returned."""
    save_peft_adapter(out_dir / "adapter", adapter_state(hf_state), alpha=alpha, dropout=dropout, base_model=base_model)
    return merged_state(hf_state, adapter_scale(hf_state, alpha))
