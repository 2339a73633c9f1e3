"""Varlen attention for packed rows, as a transformers attention implementation ("relayrl_varlen").

Packed rows (trainer/packing.py) pass the samples' cumulative lengths down to every attention call
(`cu_seq_lens_q`, FlashAttention's keyword arguments); this implementation attends within each of them:
torch's flash varlen kernel (`torch.nn.attention.varlen.varlen_attn`) on CUDA in bf16/fp16, and elsewhere one
causal scaled-dot-product attention per segment (the same numbers: what tests check on CPU). Without
`cu_seq_lens_q` (an ordinary padded batch, a reference forward) it is transformers' sdpa attention, mask included.
"""

import functools
import inspect
import itertools

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

VARLEN = "relayrl_varlen"


def flash_varlen_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's flash varlen kernel runs here: a CUDA device, half precision, a torch that has it."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401  torch >= 2.10
    except ImportError:
        return False
    return True


def use_varlen(lm: torch.nn.Module) -> None:
    """Make `lm` (a transformers model) attend through this implementation."""
    AttentionInterface.register(VARLEN, varlen_attention)
    AttentionMaskInterface.register(VARLEN, _mask)
    lm.set_attn_implementation(VARLEN)


def _mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """No mask at all for rows without padding (packed rows, or plainly causal ones); sdpa's otherwise."""
    return None if attention_mask is None else sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query [R, Hq, L, D], key/value [R, Hkv, L, D] -> ([R, L, Hq, D], None), causal within each segment."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kwargs.get("sliding_window") is not None or dropout:
        raise ValueError("varlen attention: no sliding window or dropout in packed rows")
    rows, heads, length, dim = query.shape
    q, k, v = (x.transpose(1, 2).reshape(rows * length, x.shape[1], dim) for x in (query, key, value))
    if flash_varlen_available(q.device, q.dtype):
        out = _flash(q, k, v, cu_seq_lens_q, max_length_q, scaling)
    else:
        out = _per_segment(q, k, v, cu_seq_lens_q, scaling)
    return out.view(rows, length, heads, dim), None


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    """The keyword arguments this torch's varlen_attn takes (read once: its signature changed between releases)."""
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash(q, k, v, cu_seqlens, max_len, scaling) -> torch.Tensor:
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_parameters()
    if "enable_gqa" not in params and k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    options = {"enable_gqa": k.shape[1] != q.shape[1]} if "enable_gqa" in params else {}
    options |= {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}  # 2.10: is_causal
    if "scale" in params:
        options["scale"] = scaling
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **options)


def _per_segment(q, k, v, cu_seqlens, scaling) -> torch.Tensor:
    """One causal attention per segment: [tokens, H, D] in and out."""
    out = torch.empty_like(q)
    gqa = k.shape[1] != q.shape[1]
    bounds = cu_seqlens.tolist()
    for start, end in itertools.pairwise(bounds):
        segment = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
            is_causal=True, scale=scaling, enable_gqa=gqa,
        )
        out[start:end] = segment.transpose(0, 1)
    return out
