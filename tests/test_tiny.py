"""The tiny-model kit: folders load offline with transformers and generate; the tokenizer round-trips."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout.model.tiny import CHARACTERS, char_tokenizer, write_tiny_model


def test_char_tokenizer_ids_and_round_trip():
    tokenizer = char_tokenizer()
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    text = "".join(CHARACTERS)
    ids = tokenizer(text).input_ids
    assert ids == list(range(3, 3 + len(CHARACTERS)))
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([1, *tokenizer("a b").input_ids, 2], skip_special_tokens=True) == "a b"


@pytest.mark.parametrize("arch,head_dim,tied", [("qwen2", 32, False), ("qwen3", 32, True), ("llama", 64, False)])
def test_tiny_model_loads_offline_and_generates(tmp_path, monkeypatch, arch, head_dim, tied):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = write_tiny_model(tmp_path / arch, arch=arch, head_dim=head_dim, tie_word_embeddings=tied, seed=3)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in path.iterdir()}
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch and config["head_dim"] == head_dim

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert len(tokenizer) == model.config.vocab_size
    text = "12+34=\nab c"
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == char_tokenizer()(text).input_ids  # AutoTokenizer's class encodes like ours
    assert tokenizer.decode(ids[0]) == text
    out = model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert out.shape == (1, ids.shape[1] + 8)
    assert torch.equal(out[0, : ids.shape[1]], ids[0])


def test_same_seed_same_weights_and_bad_arguments(tmp_path):
    a = write_tiny_model(tmp_path / "a", seed=7)
    b = write_tiny_model(tmp_path / "b", seed=7)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="head_dim"):
        write_tiny_model(tmp_path / "c", head_dim=16, hidden_size=64)
    with pytest.raises(ValueError, match="head_dim"):
        write_tiny_model(tmp_path / "d", arch="qwen2", hidden_size=128, head_dim=64)
    with pytest.raises(ValueError, match="arch"):
        write_tiny_model(tmp_path / "e", arch="gpt2")
