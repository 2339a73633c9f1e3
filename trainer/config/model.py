"""The `model:` section of the trainer config: how the policy computes, where memory goes at real sizes."""

from typing import Literal

from pydantic import Field, field_validator

from services.config import Strict


class LoraConfig(Strict):
    """LoRA (trainer/lora.py): low-rank adapters on the decoder's linear layers; only they (and PPO's value head)
    train, the base stays frozen, the reference policy is the same model with its adapters off (docs/lora.md)."""

    rank: int = Field(8, gt=0, description="Rank r of each adapter: A is [r, in], B is [out, r].")
    alpha: float = Field(16.0, gt=0, description="The update is scaled by alpha / rank (peft's lora_alpha).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input in forwards with "
                           "gradients (the training forward); forward-only passes (logprobs) never drop.")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="Leaf names of the linear layers to adapt inside the decoder layers (q_proj, k_proj, "
        "v_proj, o_proj, gate_proj, up_proj, down_proj), or all-linear: every one of them (never the LM head).")

    @field_validator("target_modules")
    @classmethod
    def _some(cls, value):
        if not value:
            raise ValueError("target_modules: name at least one layer, or all-linear")
        return value

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class ModelConfig(Strict):
    """Memory and precision of the policy's forward and backward (docs/trainer.md, "Memory")."""

    logprob_chunk_tokens: int = Field(
        1024, gt=0, description="Tokens per chunk of the LM head, log-softmax and entropy (trainer/lm_head.py): the "
        "[tokens, vocabulary] logits exist one chunk at a time, in the forward and (recomputed) in the backward. "
        "At vocabulary 151,936 a 1,024-token chunk is 0.6 GB of float32 logits.")
    lm_head_fp32: bool = Field(
        False, description="The LM head's matmul in float32 even when the model computes in bf16 (the log-softmax "
        "always is): logprobs closer to a float32 rollout engine's, at the cost of a float32 head matmul.")
    activation_checkpointing: bool = Field(
        False, description="Recompute each decoder layer's activations in the backward instead of keeping them "
        "(torch.utils.checkpoint per layer, applied where the policy is parallelised): activation memory of about "
        "one layer instead of all, for about one more forward pass of compute.")
    lora: LoraConfig | None = Field(
        None, description="Train low-rank adapters instead of the whole model (trainer/lora.py, docs/lora.md): "
        "{rank, alpha, dropout, target_modules}. Publishes send the base once, then the adapter alone. None = full "
        "fine-tuning.")
    freeze_vision: bool = Field(
        False, description="A vision-language policy: keep its vision tower's weights as loaded (no gradient, no "
        "update); the tower is published with the rest either way (docs/multimodal.md).")
