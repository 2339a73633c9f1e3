"""Tiny-model kit: a char-level tokenizer and small randomly initialised Qwen2/Qwen3/Llama/Qwen3-MoE folders
(and Qwen2.5-VL, through rollout/model/tiny_vlm.py).

Tests, benchmarks and the quickstart build models here instead of downloading them. A folder
written by `write_tiny_model` holds config.json, model.safetensors and the tokenizer files, and
loads with transformers' `AutoModelForCausalLM` / `AutoTokenizer` under `HF_HUB_OFFLINE=1`, with
the native engine and with vLLM (head_dim >= 32: vLLM's CPU attention refuses 16).
"""

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
# Printable ASCII (space .. '~'), newline and tab; other characters are dropped when encoding
# (both here and in transformers' rebuilt Qwen2 tokenizer, whose BPE has no unk token).
CHARACTERS = [chr(code) for code in range(32, 127)] + ["\n", "\t"]


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode map used by byte-level BPE (space is 'Ġ', newline 'Ċ')."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {byte: chr(byte) for byte in printable}
    for extra, byte in enumerate(b for b in range(256) if b not in mapping):
        mapping[byte] = chr(256 + extra)
    return mapping


_BYTE_LEVEL = _byte_level_alphabet()
# A ChatML-like chat template in the tiny vocabulary: each message is "<bos>role\ncontent<eos>\n"
# (<eos> ends a turn, so generation stops there); an assistant's tool calls follow its content as
# <tool_call>{"name": ..., "arguments": {...}}</tool_call>; `tools` become a first system message.
CHAT_TEMPLATE = (
    "{% if tools %}<bos>system\ntools: {{ tools | tojson }}<eos>\n{% endif %}"
    "{% for m in messages %}<bos>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{\"name\": \"{{ c['function']['name'] }}\", "
    "\"arguments\": {% if c['function']['arguments'] is string %}{{ c['function']['arguments'] }}"
    "{% else %}{{ c['function']['arguments'] | tojson }}{% endif %}}</tool_call>{% endfor %}{% endif %}"
    "<eos>\n{% endfor %}{% if add_generation_prompt %}<bos>assistant\n{% endif %}"
)
_CONFIG_CLASSES = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: <pad>=0, <bos>=1, <eos>=2, one id per character, <unk> last.

    It is a byte-level BPE without merges, so transformers' Qwen2 tokenizer class (which
    AutoTokenizer forces on every `model_type: qwen2` folder, rebuilding the pipeline from the
    vocabulary) encodes and decodes exactly like it. Encoding adds no special tokens (prepend
    `bos_token_id` yourself when wanted); decoding puts no spaces between characters.
    """
    vocab = {PAD: 0, BOS: 1, EOS: 2}
    for char in CHARACTERS:
        vocab[_BYTE_LEVEL[ord(char)]] = len(vocab)
    vocab[UNK] = len(vocab)  # declared so the Qwen2 class does not add its own "<|endoftext|>"
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def write_tiny_model(
    path: str | Path,
    *,
    arch: str = "qwen2",
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    rope_theta: float = 10000.0,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    moe_intermediate_size: int | None = None,
    norm_topk_prob: bool = True,
    mlp_only_layers: tuple[int, ...] = (),
    decoder_sparse_step: int = 1,
) -> Path:
    """Write a randomly initialised decoder (seeded) plus `char_tokenizer()` to `path`; return it.

    `arch` is "qwen2", "qwen3" (adds q/k RMSNorm), "llama" or "qwen3_moe" (Qwen3 whose layers run
    `num_experts` experts of width `moe_intermediate_size` (default hidden_size / 2), top `num_experts_per_tok`,
    save those in `mlp_only_layers` and those i with (i + 1) % decoder_sparse_step != 0; the arguments from
    `num_experts` on are its alone; saved
    with per-expert weight names, as transformers writes them). Qwen2 derives head_dim from hidden_size /
    num_heads in vLLM, so for qwen2 the two must agree. `intermediate_size` defaults to 4 * hidden_size.
    "qwen2_5_vl" writes a vision-language model (rollout/model/tiny_vlm.py's write_tiny_vlm, with its defaults for
    the vision tower and the image processor).
    """
    if arch == "qwen2_5_vl":
        from rollout.model.tiny_vlm import (
            write_tiny_vlm,  # transformers' VLM classes: imported when asked for
        )

        return write_tiny_vlm(path, char_tokenizer(), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                              num_kv_heads=num_kv_heads, intermediate_size=intermediate_size, seed=seed, dtype=dtype,
                              max_position_embeddings=max_position_embeddings, rope_theta=rope_theta)
    if arch not in _CONFIG_CLASSES:
        raise ValueError(f"arch: expected one of {sorted(_CONFIG_CLASSES)}, got {arch!r}")
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_TORCH_DTYPES)}, got {dtype!r}")
    if head_dim < 32:
        raise ValueError(f"head_dim: must be >= 32 (vLLM's CPU attention refuses smaller), got {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: {num_kv_heads} does not divide num_heads={num_heads}")
    if arch == "qwen2" and head_dim * num_heads != hidden_size:
        raise ValueError(
            f"head_dim: qwen2 needs head_dim * num_heads == hidden_size ({head_dim} * {num_heads} != {hidden_size})"
        )
    tokenizer = char_tokenizer()
    moe = {}
    if arch == "qwen3_moe":
        moe = {"num_experts": num_experts, "num_experts_per_tok": num_experts_per_tok,
               "moe_intermediate_size": moe_intermediate_size or hidden_size // 2, "norm_topk_prob": norm_topk_prob,
               "mlp_only_layers": list(mlp_only_layers), "decoder_sparse_step": decoder_sparse_step}
    config = _CONFIG_CLASSES[arch](
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **moe,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(_TORCH_DTYPES[dtype])
    model.config.dtype = dtype
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


WORD_SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def word_tokenizer(words: list[str], pre_tokenizer=None) -> PreTrainedTokenizerFast:
    """A word-level tokenizer: ids 0-3 are WORD_SPECIALS, then `words` in order; text is split by `pre_tokenizer`
    (default: whitespace and punctuation apart) and decoded with spaces between tokens. The bring-your-own
    examples and tests use it for a model whose tokenizer is not the quickstart's."""
    vocab = {token: index for index, token in enumerate([*WORD_SPECIALS, *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizer or pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                   eos_token="<eos>", unk_token="<unk>")


def write_llama(folder: str | Path, tokenizer: PreTrainedTokenizerFast, *, seed: int = 0, hidden_size: int = 128,
                intermediate_size: int = 256, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                head_dim: int = 32, max_position_embeddings: int = 64) -> Path:
    """A randomly initialised (seeded) Llama sized to `tokenizer`, saved with it as a Hugging Face folder."""
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=head_dim, max_position_embeddings=max_position_embeddings,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
