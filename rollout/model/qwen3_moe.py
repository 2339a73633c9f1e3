"""Qwen3-MoE: the Qwen3 decoder (q/k norm, GQA, RoPE) whose sparse layers run a SparseMoeBlock instead of the MLP
(transformers' Qwen3MoeForCausalLM). Dense layers (mlp_only_layers, decoder_sparse_step) keep the gated MLP."""

import torch
from torch import nn

from rollout.model.decoder import MLP, CausalLM
from rollout.model.moe import SparseMoeBlock, expert_alias


class Qwen3MoeForCausalLM(CausalLM):
    def make_mlp(self, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        moe = self.config.moe
        if moe.is_sparse(layer):
            return SparseMoeBlock(self.config.hidden_size, moe, dtype, device)
        return MLP(self.config, dtype, device)

    def weight_alias(self, name: str) -> tuple[str, tuple] | None:
        return expert_alias(name, self.config.moe)

    def routed_experts(self) -> torch.Tensor | None:
        """The experts each token of the last forward was routed to, [T, sparse layers, top_k] (routing replay)."""
        blocks = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
        return torch.stack([block.routed for block in blocks], dim=1) if blocks else None
