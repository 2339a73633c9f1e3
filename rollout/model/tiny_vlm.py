"""Tiny-model kit, vision-language part: a small randomly initialised Qwen2.5-VL folder built in code.

`write_tiny_vlm` (reached as rollout/model/tiny.py's `write_tiny_model(arch="qwen2_5_vl")`) writes config.json,
model.safetensors, the kit's char tokenizer with Qwen's vision tokens added, and a saved image processor (`Qwen2VLImageProcessorPil`: Pillow only, no torchvision), so the
folder loads with transformers' `Qwen2_5_VLForConditionalGeneration`, `AutoTokenizer` and `AutoImageProcessor`
under `HF_HUB_OFFLINE=1`, and with the native engine.
"""

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

# Qwen's vision tokens, in the order they follow the char vocabulary: an image is written into a prompt as
# VISION_START, IMAGE_PAD once per image token (grid_t * grid_h * grid_w / merge_size**2 of them), VISION_END.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
PATCH_SIZE, MERGE_SIZE = 14, 2
IMAGE_FACTOR = PATCH_SIZE * MERGE_SIZE  # images are resized to multiples of 28 pixels a side


def add_vision_tokens(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """`tokenizer` (the kit's char tokenizer) with the vision tokens added as special tokens (one id each, never
    split), after its vocabulary."""
    tokenizer.add_special_tokens({"additional_special_tokens": [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]})
    return tokenizer


def image_processor(min_pixels: int = 2 * 2 * IMAGE_FACTOR**2,
                    max_pixels: int = 8 * 8 * IMAGE_FACTOR**2) -> Qwen2VLImageProcessorPil:
    """Qwen2-VL's image processor (Pillow): resizes to multiples of 28 pixels a side, within [min, max] pixels
    (defaults: 56x56 .. 224x224, 4 .. 64 image tokens)."""
    return Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels, patch_size=PATCH_SIZE,
                                    merge_size=MERGE_SIZE, temporal_patch_size=2)


def write_tiny_vlm(
    path: str | Path,
    tokenizer: PreTrainedTokenizerFast,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vision_hidden_size: int = 64,
    vision_depth: int = 2,
    vision_heads: int = 2,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    rope_theta: float = 10000.0,
    max_pixels: int = 8 * 8 * IMAGE_FACTOR**2,
) -> Path:
    """Write a randomly initialised (seeded) Qwen2.5-VL to `path`, with `tokenizer` plus the vision tokens; return it.

    The text decoder is Qwen2's (q/k/v bias, head_dim = hidden_size / num_heads) with M-RoPE whose sections split
    head_dim / 2 as [1/4, 3/8, 3/8] (Qwen's 16/24/24 of 64); the vision tower has `vision_depth` blocks (the last
    with full attention, the others windowed) and merges 2x2 patches into one token of width hidden_size.
    """
    if hidden_size % num_heads or (hidden_size // num_heads) % 16:
        raise ValueError(f"hidden_size: {hidden_size} / num_heads {num_heads} must be a head_dim divisible by 16")
    tokenizer = add_vision_tokens(tokenizer)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)}
    half = hidden_size // num_heads // 2
    section = [half // 4, 3 * half // 8, half - half // 4 - 3 * half // 8]
    special = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id,
               "eos_token_id": tokenizer.eos_token_id}
    text = {"vocab_size": len(tokenizer), "hidden_size": hidden_size,
            "intermediate_size": intermediate_size or 4 * hidden_size, "num_hidden_layers": num_layers,
            "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
            "max_position_embeddings": max_position_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, "mrope_section": section}, **special}
    vision = {"depth": vision_depth, "hidden_size": vision_hidden_size, "intermediate_size": 2 * vision_hidden_size,
              "num_heads": vision_heads, "out_hidden_size": hidden_size, "patch_size": PATCH_SIZE,
              "spatial_merge_size": MERGE_SIZE, "temporal_patch_size": 2, "window_size": 2 * IMAGE_FACTOR,
              "fullatt_block_indexes": [vision_depth - 1]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids[IMAGE_PAD],
                              video_token_id=ids[VIDEO_PAD], vision_start_token_id=ids[VISION_START],
                              vision_end_token_id=ids[VISION_END], tie_word_embeddings=False, **special)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config).to({"float32": torch.float32, "bfloat16": torch.bfloat16,
                                                           "float16": torch.float16}[dtype])
    model.config.dtype = dtype
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    image_processor(max_pixels=max_pixels).save_pretrained(out)
    return out
