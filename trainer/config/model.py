"""The `model:` section of the trainer config: how the policy computes, where memory goes at real sizes."""

from pydantic import Field

from services.config import Strict


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
    freeze_vision: bool = Field(
        False, description="A vision-language policy: keep its vision tower's weights as loaded (no gradient, no "
        "update); the tower is published with the rest either way (docs/multimodal.md).")
