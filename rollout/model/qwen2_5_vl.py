"""Qwen2.5-VL: the Qwen2 decoder with multimodal rotary positions (M-RoPE) plus transformers' own vision tower.

The tower (transformers' Qwen2_5_VisionTransformerPretrainedModel, loaded from the same checkpoint's `visual.*`
weights) turns an image's patches into one embedding per image token; the engine runs it at prefill
(`encode_images`) and splices its rows over the image placeholder tokens (CausalLM.forward's `embeds`). Positions
are 3-D ([3, T]: temporal, height, width; rollout/engine/multimodal.py computes them per request): each rotary
frequency takes its angle from one of the three, as `mrope_section` assigns them. Text tokens carry three equal
positions, where M-RoPE equals plain RoPE.
"""

import torch

from rollout.config import ModelConfig
from rollout.model.decoder import CausalLM
from rollout.model.layers import RotaryEmbedding

# transformers' in-memory names (a trainer's state dict) -> the checkpoint names this model's parameters carry
_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose frequencies split into sections driven by the temporal, height and width positions."""

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device):
        super().__init__(config, max_positions, dtype, device)
        sections = config.vision.mrope_section
        if sum(sections) != config.head_dim // 2:
            raise ValueError(f"mrope_section: {list(sections)} must sum to head_dim / 2 = {config.head_dim // 2}")
        half = torch.cat([torch.full((n,), axis) for axis, n in enumerate(sections)])
        self.register_buffer("axis", torch.cat((half, half)).to(device=device, dtype=torch.int64), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin of `positions` ([T], or [3, T] per axis), shaped [T, 1, head_dim]."""
        if positions.dim() == 1:
            return super().tables(positions)
        index = self.axis.expand(1, positions.shape[1], -1)
        cos = self.cos[positions].gather(0, index)[0]
        signed_sin = self.signed_sin[positions].gather(0, index)[0]
        return cos.unsqueeze(1), signed_sin.unsqueeze(1)


class Qwen2_5_VLForConditionalGeneration(CausalLM):
    mrope = True

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                 head_fp32: bool = False):
        super().__init__(config, max_positions, dtype, device, head_fp32)
        self.model.rotary_emb = MRotaryEmbedding(config, max_positions, dtype, device)
        from transformers import Qwen2_5_VLVisionConfig  # heavy: imported only where a VLM is served
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        tower = Qwen2_5_VLVisionConfig(**config.vision.tower)
        with torch.device(device):
            self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(tower, dtype=dtype)
        self.visual.eval().requires_grad_(False)

    def published_name(self, name: str) -> str:
        for prefix, checkpoint_prefix in _PREFIXES:
            if name.startswith(checkpoint_prefix):
                return prefix + name[len(checkpoint_prefix):]
        return name

    def weight_alias(self, name: str) -> tuple[str, tuple | None] | None:
        for prefix, checkpoint_prefix in _PREFIXES:
            if name.startswith(prefix):
                return checkpoint_prefix + name[len(prefix):], None
        return None

    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Embeddings [image tokens, hidden] of the images whose patches are `pixel_values` ([patches, C * t * p * p],
        the image processor's rows, images back to back) over grids `grid_thw` ([images, 3])."""
        pixels = pixel_values.to(self.visual.dtype)
        return self.visual(pixels, grid_thw=grid_thw).pooler_output
