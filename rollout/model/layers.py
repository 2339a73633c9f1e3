"""Building blocks of the decoder: RMSNorm, rotary embedding, and merged projections with HF names."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from rollout.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as transformers' Qwen2/Llama do.

    float32 inputs take torch's fused rms_norm (one op, same result); other dtypes follow
    transformers step by step (normalise in float32, round, then scale), so bf16 matches it too.
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies of plain, linear-scaled or Llama-3 RoPE (float32, head_dim / 2 entries)."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise NotImplementedError(f"rope_scaling: rope_type {scaling['rope_type']!r} is not supported by the native engine")


class RotaryEmbedding(nn.Module):
    """RoPE with cos/sin tables precomputed for every position (transformers' rotate-half convention).

    rotate_half(x) * sin == roll(x, half) * signed_sin with signed_sin = [-sin, sin] over the two
    halves: one roll instead of two slices, a negation and a cat, with bit-identical results.
    """

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inverse_frequencies(config)[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        sign = torch.cat((-torch.ones_like(freqs[0]), torch.ones_like(freqs[0])))
        self.register_buffer("cos", angles.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("signed_sin", (angles.sin() * sign).to(dtype=dtype, device=device), persistent=False)
        self.half = config.head_dim // 2

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of `positions` ([T]), shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate x ([T, heads, head_dim]) by the tables of its positions."""
        return x * cos + x.roll(self.half, dims=-1) * signed_sin


class ProjectionView(nn.Module):
    """One checkpoint-named projection (e.g. `q_proj`) whose weight is a slice of a merged matrix.

    Loading into `q_proj.weight` by name writes straight into the merged matrix the forward uses,
    so the model keeps Hugging Face parameter names and still runs one matmul for q, k and v.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)


def add_merged_projections(
    owner: nn.Module,
    prefix: str,
    in_features: int,
    parts: dict[str, int],
    bias: bool,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Give `owner` one ProjectionView per part plus buffers `<prefix>_weight` (and `_bias`) merging them.

    `owner.merged_projections[prefix]` lists the parts in merge order (see rebind_merged).
    """
    weight = torch.zeros(sum(parts.values()), in_features, dtype=dtype, device=device)
    merged_bias = torch.zeros(sum(parts.values()), dtype=dtype, device=device) if bias else None
    owner.register_buffer(f"{prefix}_weight", weight, persistent=False)
    owner.register_buffer(f"{prefix}_bias", merged_bias, persistent=False)
    if not hasattr(owner, "merged_projections"):
        owner.merged_projections = {}
    owner.merged_projections[prefix] = tuple(parts)
    start = 0
    for name, size in parts.items():
        part_bias = None if merged_bias is None else merged_bias[start : start + size]
        setattr(owner, name, ProjectionView(weight[start : start + size], part_bias))
        start += size


def merge_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    """The parts stacked along dim 0, without a copy when they already lie back to back in one storage
    (as a weight update's staging buffers hold them when sent in merge order), else as a new tensor."""
    first = parts[0]
    rows = sum(part.shape[0] for part in parts)
    end = first.data_ptr()
    adjacent = True
    for part in parts:
        adjacent = (adjacent and part.is_contiguous() and part.dtype == first.dtype and part.device == first.device
                    and part.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                    and part.data_ptr() == end)
        end = part.data_ptr() + part.nbytes
    if adjacent:
        return first.as_strided((rows, *first.shape[1:]), first.stride())
    return torch.cat(parts)


def rebind_merged(owner: nn.Module, prefix: str, kind: str, merged: torch.Tensor) -> None:
    """Make `merged` the storage of `owner`'s `<prefix>_<kind>` buffer and of its parts' `kind` parameters."""
    setattr(owner, f"{prefix}_{kind}", merged)
    start = 0
    for name in owner.merged_projections[prefix]:
        param = getattr(getattr(owner, name), kind)
        param.data = merged[start : start + param.shape[0]]
        start += param.shape[0]
