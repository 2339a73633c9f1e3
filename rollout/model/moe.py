"""Mixture-of-experts feed-forward block: a top-k router and experts run grouped (tokens sorted by expert, one
matmul pair per expert that has tokens). Parameter names and layouts are transformers' (5.25) own: `gate.weight`
[E, hidden], `experts.gate_up_proj` [E, 2 * I, hidden] (gate rows first) and `experts.down_proj` [E, hidden, I],
so a trainer's state dict loads by name; per-expert checkpoint names load as parts of them (see expert_alias).
"""

import re

import torch
import torch.nn.functional as F
from torch import nn

from rollout.config import MoeConfig

# A per-expert checkpoint name, as checkpoints on the Hub (and transformers' save_pretrained) write them.
_EXPERT_NAME = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class TopKRouter(nn.Module):
    """Softmax over the experts in float32, top-k, renormalised when norm_topk_prob (transformers'
    Qwen3MoeTopKRouter): returns the weights [T, k] in the input dtype and the experts [T, k]."""

    def __init__(self, hidden_size: int, moe: MoeConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.top_k, self.norm_topk_prob = moe.num_experts_per_tok, moe.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts


class Experts(nn.Module):
    """E gated SiLU MLPs stored stacked; forward runs each expert once over the rows routed to it, in torch or, with
    `kernel` "triton" (set_moe_kernel), as the fused grouped GEMMs of rollout/model/moe_triton.py."""

    kernel = "torch"

    def __init__(self, hidden_size: int, moe: MoeConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        experts, inner = moe.num_experts, moe.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, 2 * inner, hidden_size, dtype=dtype, device=device),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(experts, hidden_size, inner, dtype=dtype, device=device),
                                      requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """sum over k of weights[t, k] * expert[experts[t, k]](x[t]), for x [T, hidden]."""
        if self.kernel == "triton":
            from rollout.model.moe_triton import fused_experts  # triton imported only where the kernel runs

            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, experts)
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # rows grouped by expert; within one, in token order
        rows = order // top_k  # the token of each grouped row
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        grouped = x[rows]
        out = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                part = slice(start, start + count)
                gate, up = F.linear(grouped[part], self.gate_up_proj[expert]).chunk(2, dim=-1)
                out[part] = F.linear(F.silu(gate) * up, self.down_proj[expert])
                start += count
        out *= weights.flatten()[order, None]
        # Summed per token in expert order, as transformers' Qwen3MoeExperts adds them.
        return torch.zeros_like(x).index_add_(0, rows, out)


class SparseMoeBlock(nn.Module):
    """Router plus experts: a drop-in for the dense MLP of a layer (x [T, hidden] -> [T, hidden])."""

    def __init__(self, hidden_size: int, moe: MoeConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.gate = TopKRouter(hidden_size, moe, dtype, device)
        self.experts = Experts(hidden_size, moe, dtype, device)
        self.routed: torch.Tensor | None = None  # the experts [T, k] of the last forward (routing replay, R3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        self.routed = experts
        return self.experts(x, weights, experts)


def set_moe_kernel(model: nn.Module, kernel: str) -> None:
    """Who runs every experts layer of `model`: "torch" or "triton" (EngineConfig.moe_kernel)."""
    for module in model.modules():
        if isinstance(module, Experts):
            module.kernel = kernel


def expert_alias(name: str, moe: MoeConfig) -> tuple[str, tuple] | None:
    """(stacked parameter name, index) of a per-expert checkpoint name (`...mlp.experts.3.up_proj.weight` ->
    `...mlp.experts.gate_up_proj`, [3, I:2I]); None for any other name or an expert the model does not have."""
    match = _EXPERT_NAME.match(name)
    if match is None or int(match[2]) >= moe.num_experts:
        return None
    prefix, expert, kind = match[1], int(match[2]), match[3]
    inner = moe.moe_intermediate_size
    if kind == "down_proj":
        return f"{prefix}.down_proj", (expert,)
    rows = slice(0, inner) if kind == "gate_proj" else slice(inner, 2 * inner)
    return f"{prefix}.gate_up_proj", (expert, rows)
