"""Which model class serves each model_type: a new family is one entry here plus its model file (sharing
rollout/model/decoder.py's layers); the scheduler, KV cache and sessions never branch on the architecture."""

from rollout.config import SUPPORTED_MODEL_TYPES
from rollout.model.decoder import CausalLM
from rollout.model.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from rollout.model.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "qwen2": CausalLM,
    "qwen3": CausalLM,
    "llama": CausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
    "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
}


def model_class(model_type: str) -> type[CausalLM]:
    """The class of `model_type`; ValueError names the supported ones."""
    if model_type not in MODEL_CLASSES:
        raise ValueError(f"model_type: {model_type!r} is not supported (expected one of {SUPPORTED_MODEL_TYPES})")
    return MODEL_CLASSES[model_type]
