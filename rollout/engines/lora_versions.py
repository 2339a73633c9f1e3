"""LoRA adapters served unmerged by vLLM and SGLang (their `lora.mode: unmerged`; docs/lora.md): each adapter-only
weight version becomes an adapter of the engine's own, and each request is pinned to the version it was submitted on.

The update names adapters as the trainer publishes them (trainer/adapter_publish.py): `<module>.lora_A.weight` [r, in]
and `<module>.lora_B.weight` [out, r], B pre-scaled by alpha / r. peft_adapter renames them as a PEFT adapter
(`base_model.model.<module>...`) whose config says lora_alpha = r (scale 1), so the engine serves W x + B (A x) with
the published B; the engines fuse q/k/v and gate/up themselves from the per-module names.

- vLLM loads an adapter through its documented API, a `LoRARequest(name, int id, path)` of a PEFT adapter folder
  (`LLMEngine.add_lora`); it has no public call that takes tensors. So the tensors are written once per version as a
  PEFT folder (adapter_model.safetensors + adapter_config.json) under a temporary directory (in /dev/shm where there
  is one: memory, no disk), which vLLM reads into its LoRA slots; the folder stays while vLLM may load the adapter
  again (its LRU cache reloads an evicted adapter from the path).
- SGLang takes the tensors themselves (`load_lora_adapter_from_tensors`; GPU only).

AdapterVersions keeps the bookkeeping (pure): which versions are resident, their ids, which may leave. A version
stays while it is among the newest `versions_resident` or an unfinished request is pinned to it (a request finishes on
the adapter it started with, as in the native engine); beyond that it is removed from the engine (and its folder).
"""

import json
import shutil
import tempfile
import weakref
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rollout.model.lora import LORA_A, LORA_B

PEFT_PREFIX = "base_model.model."
# The projections vLLM's and SGLang's Qwen2 / Qwen3 / Llama models take LoRA on (unfused names).
LORA_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})


def adapter_problem(weight: str, max_rank: int | None = None, rank: int | None = None) -> str | None:
    """Why vLLM / SGLang cannot serve an adapter of parameter `weight` (published name) unmerged; None when it can."""
    module = weight.removesuffix(".weight").rsplit(".", 1)[-1]
    if module not in LORA_MODULES:
        return (f"vLLM and SGLang serve LoRA on {sorted(LORA_MODULES)} only, not on {weight!r}: serve this policy "
                "with engine.lora.mode merged")
    if rank is not None and max_rank is not None and rank > max_rank:
        return f"adapter rank {rank} exceeds engine.lora.max_rank {max_rank} (the engine's max_lora_rank)"
    return None


def peft_adapter(adapters: Mapping[str, torch.Tensor], max_rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """The PEFT adapter of an update's adapters: (tensors under PEFT's names, adapter_config) with lora_alpha = r,
    since B comes pre-scaled. Raises ValueError for adapters vLLM cannot serve (a module it has no LoRA layer for,
    mixed ranks, a rank above max_rank, a lora_A without its lora_B)."""
    modules = sorted({name.removesuffix(LORA_A).removesuffix(LORA_B) for name in adapters})
    if not modules:
        raise ValueError("the update has no LoRA adapters")
    ranks, tensors = set(), {}
    for module in modules:
        a, b = adapters.get(module + LORA_A), adapters.get(module + LORA_B)
        if a is None or b is None:
            raise ValueError(f"adapter of {module!r}: needs both lora_A and lora_B")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter of {module!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit")
        problem = adapter_problem(module + ".weight", max_rank, a.shape[0])
        if problem is not None:
            raise ValueError(problem)
        ranks.add(a.shape[0])
        tensors[PEFT_PREFIX + module + LORA_A] = a.detach().contiguous()
        tensors[PEFT_PREFIX + module + LORA_B] = b.detach().contiguous()
    if len(ranks) != 1:
        raise ValueError(f"vLLM serves one rank per adapter; the update has ranks {sorted(ranks)}")
    rank = ranks.pop()
    targets = sorted({module.rsplit(".", 1)[-1] for module in modules})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": targets, "bias": "none",
              "lora_dropout": 0.0, "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
              "modules_to_save": None}
    return tensors, config


def write_peft_folder(folder: Path, adapters: Mapping[str, torch.Tensor], max_rank: int) -> Path:
    """Write the update's adapters as a PEFT adapter folder (what a LoRARequest's path names); returns it."""
    from safetensors.torch import save_file

    tensors, config = peft_adapter(adapters, max_rank)
    folder.mkdir(parents=True, exist_ok=False)
    save_file({name: t.cpu() for name, t in tensors.items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@dataclass
class AdapterVersions:
    """The adapter versions resident in an engine: weight version -> (its LoRA int id, its PEFT folder if written)."""

    versions_resident: int
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(
        prefix="relayrl-vllm-lora-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)))
    resident: dict[int, tuple[int, Path]] = field(default_factory=dict)
    _next_id: int = 1

    def __post_init__(self) -> None:
        weakref.finalize(self, shutil.rmtree, self.root, True)  # the folders go with the engine, or at exit

    def add(self, version: int, adapters: Mapping[str, torch.Tensor], max_rank: int,
            write: bool = True) -> tuple[int, Path]:
        """Give `version` an id (never reused: vLLM caches adapters by id) and, with `write`, write its PEFT folder
        (else only check its adapters); returns (id, folder)."""
        if version in self.resident:
            raise ValueError(f"adapter version {version} is resident already")
        folder = self.root / f"v{version}"
        if write:
            write_peft_folder(folder, adapters, max_rank)
        else:
            peft_adapter(adapters, max_rank)
        self.resident[version] = (self._next_id, folder)
        self._next_id += 1
        return self.resident[version]

    def leaving(self, in_use: Container[int]) -> list[int]:
        """The versions that may leave now: older than the newest versions_resident, no unfinished request on them."""
        newest = sorted(self.resident)[-self.versions_resident:]
        return [v for v in sorted(self.resident) if v not in newest and v not in in_use]

    def remove(self, version: int) -> int:
        """Forget `version` and delete its folder; returns its id (vLLM's LLMEngine.remove_lora takes it)."""
        lora_id, folder = self.resident.pop(version)
        shutil.rmtree(folder, ignore_errors=True)
        return lora_id
