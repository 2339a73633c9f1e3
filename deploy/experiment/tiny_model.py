"""The tiny decoder built in code (an experiment's model.tiny): its shape, and the Hugging Face folder written
from it (rollout.model.tiny.write_tiny_model, with its character tokenizer)."""

import pathlib

from pydantic import Field, model_validator

from services.config import Strict

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")


class ModelConfig(Strict):
    """The tiny decoder built in code (rollout.model.tiny.write_tiny_model)."""

    arch: str = Field("qwen2", description="qwen2, qwen3, llama or qwen3_moe.")
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = Field(32, ge=32, description="Per-head width (vLLM's CPU attention needs >= 32).")
    num_experts: int | None = Field(None, ge=1, description="qwen3_moe: experts per layer (None = 4).")
    num_experts_per_tok: int | None = Field(None, ge=1, description="qwen3_moe: experts each token runs, the "
                                            "router's top-k (None = 2).")
    moe_intermediate_size: int | None = Field(None, ge=1, description="qwen3_moe: each expert's width (None = "
                                              "hidden_size / 2).")

    @model_validator(mode="after")
    def _check(self) -> "ModelConfig":
        given = [name for name in MOE_FIELDS if getattr(self, name) is not None]
        if given and self.arch != "qwen3_moe":
            raise ValueError(f"{', '.join(given)}: a mixture-of-experts shape, but arch is {self.arch!r} (give "
                             "arch: qwen3_moe, or drop them)")
        if (self.num_experts_per_tok or 2) > (self.num_experts or 4):
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok or 2} exceeds num_experts="
                             f"{self.num_experts or 4}")
        return self

    def write(self, folder: pathlib.Path, seed: int) -> pathlib.Path:
        """This model, its weights drawn from `seed`, as a Hugging Face folder at `folder`."""
        from rollout.model.tiny import write_tiny_model

        moe = {name: getattr(self, name) for name in MOE_FIELDS if getattr(self, name) is not None}
        return write_tiny_model(folder, seed=seed, arch=self.arch, hidden_size=self.hidden_size,
                                num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                head_dim=self.head_dim, **moe)
