"""A prompt's KV exported from one engine for another to import (rollout/engine/kv_handoff.py), and what the
importing engine serves, which the KV must match (rollout/pd/transfer.py checks it on the wire)."""

from dataclasses import dataclass

import torch


@dataclass
class PrefilledPrompt:
    """What a prefill produced: the prompt's KV and each completion's first token, under one weight version."""

    prompt_ids: list[int]
    keys: torch.Tensor  # [num_layers, len(prompt_ids), num_kv_heads, head_dim]
    values: torch.Tensor
    first_token_ids: list[int]  # one per completion, by index
    first_logprobs: list[float]
    seed: int  # the request's sampling seed (given or drawn by the prefill engine)
    weight_version: int
    # A prompt with images (M-RoPE, rollout/engine/multimodal.py): each prompt token's [3, len(prompt_ids)] int64
    # positions, and the offset of the tokens after the prompt (index + rope_delta). None: a text prompt.
    mrope_positions: torch.Tensor | None = None
    rope_delta: int = 0


@dataclass(frozen=True)
class ServedLayout:
    """What a receiving engine serves: a transfer must match it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    vocab_size: int
    weight_version: int
