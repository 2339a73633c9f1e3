"""Qwen2-family model folders at real shapes for the GPU benches (engine_gpu.py, trainer_gpu_step.py): random
weights, the real vocabulary size, the character tokenizer, made on the device that will run them."""

from pathlib import Path

import torch

SHAPES = {
    "qwen05b": {"hidden_size": 896, "num_layers": 24, "num_heads": 14, "num_kv_heads": 2, "head_dim": 64,
                "intermediate_size": 4864, "vocab_size": 151936},
    "wide_vocab": {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64,
                   "intermediate_size": 512, "vocab_size": 151936},
    "small": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32,
              "intermediate_size": 256, "vocab_size": 4096},
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EOS = 2


def build_model(folder: Path, shape: str, dtype: str, device: str, max_positions: int = 1024,
                head_scale: float = 1.0) -> Path:
    """A random Qwen2 folder of `shape` in `dtype`, initialised on `device` (seconds on a GPU, not a minute on a
    CPU). `head_scale` sharpens the LM head (a random model's next-token distribution is nearly flat)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from rollout.model.tiny import char_tokenizer

    s = SHAPES[shape]
    config = Qwen2Config(vocab_size=s["vocab_size"], hidden_size=s["hidden_size"],
                         intermediate_size=s["intermediate_size"], num_hidden_layers=s["num_layers"],
                         num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
                         head_dim=s["head_dim"], max_position_embeddings=max_positions,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
                         pad_token_id=0, bos_token_id=1, eos_token_id=EOS)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    model.config.dtype = dtype
    model.save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    print(f"model: {shape}, {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters", flush=True)
    return folder
