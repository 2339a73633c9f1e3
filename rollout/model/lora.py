"""LoRA adapters served unmerged: y = W x + B (A x) on the adapted projections, several versions resident.

A weight update of a LoRA policy carries `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out, r], B
pre-scaled by alpha / r (trainer/adapter_publish.py). The decoder runs q/k/v and gate/up as one matmul each
(rollout/model/layers.py), so a version keeps one pair per matmul: for a fused one, A of its adapted parts stacked
([sum r, in]) and B block-diagonal ([out, sum r], each part's B in its own rows and rank columns), so one pair of
small matmuls adds every part's update; for o_proj and down_proj, the pair as sent.

A step's rows may belong to sequences pinned to different versions (rollout/engine/llm_engine.py): `select` groups
the rows by version before the forward, and each adapted projection adds, per group, B_v (A_v x) to its rows (one
group of every row: no gather). A version that leaves (more than `capacity` resident) is forgotten; the engine moves
its sequences to the newest.
"""

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
Pair = tuple[torch.Tensor, torch.Tensor]


class ResidentAdapters:
    """The adapter versions an engine serves, and which rows of the running forward use which."""

    def __init__(self, model: nn.Module, capacity: int):
        self.capacity = capacity
        # published weight name -> (matmul key, its first row in the matmul's output, the matmul's output rows)
        self.targets: dict[str, tuple[str, int, int]] = {}
        self.versions: dict[int, dict[str, Pair]] = {}  # oldest first
        self.plan: list[tuple[dict[str, Pair], torch.Tensor | None]] = []  # (a version's pairs, its rows or all)
        for owner_name, owner in model.named_modules():
            keys = getattr(owner, "adapter_keys", None)
            if keys is None:
                continue
            owner.adapters = self
            owner.adapter_ids = {matmul: f"{owner_name}.{matmul}" for matmul in keys}  # the keys `apply` takes
            for matmul, parts in keys.items():
                key = owner.adapter_ids[matmul]
                total = sum(getattr(owner, part).weight.shape[0] for part in parts)
                start = 0
                for part in parts:
                    self.targets[model.published_name(f"{owner_name}.{part}.weight")] = (key, start, total)
                    start += getattr(owner, part).weight.shape[0]

    def problem(self, weight: str) -> str | None:
        """Why an adapter of parameter `weight` cannot be served unmerged (None: it can)."""
        if weight in self.targets:
            return None
        return (f"{weight!r} is not a projection the native engine adapts unmerged (q/k/v/o_proj, gate/up/down_proj "
                "of a dense layer); serve it merged (engine.lora.mode: merged)")

    def add(self, version: int, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype,
            device: torch.device) -> list[int]:
        """Make `tensors` (adapters under published names) resident as `version` (copied); the versions that left."""
        pieces: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
        for name, a in tensors.items():
            if not name.endswith(LORA_A):
                continue
            module = name.removesuffix(LORA_A)
            weight = module + ".weight"
            if (why := self.problem(weight)) is not None:
                raise ValueError(f"adapter {name!r}: {why}")
            key, start, total = self.targets[weight]
            pieces.setdefault(key, []).append((start, total, a, tensors[module + LORA_B]))
        pairs = {key: _pair(parts, dtype, device) for key, parts in pieces.items()}
        self.versions[version] = pairs
        left = []
        while len(self.versions) > self.capacity:
            oldest = next(iter(self.versions))
            del self.versions[oldest]
            left.append(oldest)
        return left

    def clear(self) -> None:
        self.versions.clear()
        self.plan = []

    @property
    def active(self) -> bool:
        return bool(self.versions)

    def select(self, row_versions: Sequence[int], device: torch.device) -> None:
        """Rows of the next forward, by the version each uses: one entry per row ([] ends adapting)."""
        self.plan = []
        if not self.versions or not row_versions:
            return
        first = row_versions[0]
        if all(version == first for version in row_versions):
            if first in self.versions:
                self.plan = [(self.versions[first], None)]
            return
        rows: dict[int, list[int]] = {}
        for row, version in enumerate(row_versions):
            rows.setdefault(version, []).append(row)
        self.plan = [(self.versions[version], torch.tensor(indices, dtype=torch.int64, device=device))
                     for version, indices in rows.items() if version in self.versions]

    def apply(self, key: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (= W x of matmul `key`) plus each planned version's B (A x) on its rows."""
        for pairs, rows in self.plan:
            pair = pairs.get(key)
            if pair is None:
                continue
            a, b = pair
            if rows is None:
                y.add_(F.linear(F.linear(x, a), b))
            else:
                y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b))
        return y


def _pair(parts: list[tuple[int, int, torch.Tensor, torch.Tensor]], dtype: torch.dtype, device: torch.device) -> Pair:
    """One matmul's (A, B): the parts' A stacked, their B block-diagonal in the matmul's output rows."""
    total = parts[0][1]
    if len(parts) == 1 and parts[0][0] == 0 and parts[0][3].shape[0] == total:
        _, _, a, b = parts[0]
        return a.to(device, dtype, copy=True).contiguous(), b.to(device, dtype, copy=True).contiguous()
    rank = sum(a.shape[0] for _, _, a, _ in parts)
    stacked = torch.cat([a.to(device, dtype) for _, _, a, _ in parts])
    block = torch.zeros(total, rank, dtype=dtype, device=device)
    column = 0
    for start, _, a, b in parts:
        block[start : start + b.shape[0], column : column + a.shape[0]] = b.to(device, dtype)
        column += a.shape[0]
    return stacked.contiguous(), block


def is_adapter(name: str) -> bool:
    return name.endswith((LORA_A, LORA_B))
