"""The tiny decoder built in code (an experiment's model.tiny): its shape, and the Hugging Face folder written
from it (rollout.model.tiny.write_tiny_model, with its character tokenizer)."""

import pathlib

from pydantic import Field

from services.config import Strict


class ModelConfig(Strict):
    """The tiny decoder built in code (rollout.model.tiny.write_tiny_model)."""

    arch: str = Field("qwen2", description="qwen2, qwen3, llama or qwen3_moe (4 experts, top 2).")
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = Field(32, ge=32, description="Per-head width (vLLM's CPU attention needs >= 32).")

    def write(self, folder: pathlib.Path, seed: int) -> pathlib.Path:
        """This model, its weights drawn from `seed`, as a Hugging Face folder at `folder`."""
        from rollout.model.tiny import write_tiny_model

        return write_tiny_model(folder, seed=seed, arch=self.arch, hidden_size=self.hidden_size,
                                num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                head_dim=self.head_dim)
