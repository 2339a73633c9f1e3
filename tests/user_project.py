"""A user's own project, built the way a user would: a model folder with its own word-level tokenizer (not the
quickstart's character tokenizer), a JSONL dataset, a reward function in a module beside the experiment file."""

import json
import pathlib
import random

LABELS = {"animal": ["cat", "dog", "cow", "owl"], "fruit": ["apple", "pear", "plum", "fig"],
          "tool": ["saw", "drill", "hammer", "wrench"]}
FILLERS = ["red", "big", "old", "small", "green", "new"]

REWARD_MODULE = '''
def first_word(sample, bonus=1.0):
    """1 when the completion's first word is the reference answer, else 0."""
    words = sample.response_text.split()
    return bonus if words and words[0] == sample.metadata["answer"] else 0.0
'''


def word_tokenizer():
    """A word-level tokenizer over the task's words, split on whitespace, decoded with spaces between words."""
    from tokenizers import pre_tokenizers

    from rollout.model.tiny import word_tokenizer as tokenizer_over

    words = [*LABELS, *(noun for nouns in LABELS.values() for noun in nouns), *FILLERS, "kind", "?"]
    return tokenizer_over(words, pre_tokenizers.WhitespaceSplit())


def write_model(folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A small randomly initialised Llama with the word tokenizer, saved as a Hugging Face folder."""
    from rollout.model.tiny import write_llama

    return write_llama(folder, word_tokenizer(), seed=seed, hidden_size=64, intermediate_size=128, num_heads=2,
                       num_kv_heads=1)


def write_qwen2_without_unk(folder: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A tiny Qwen2 with a 15-token word-level tokenizer that names no unk token (pad, bos, eos and 12 words), as a
    user trained it: transformers 5 loads it as Qwen2Tokenizer, whose default unk "<|endoftext|>" becomes id 15."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    words = ["<pad>", "<bos>", "<eos>", *LABELS, "cat", "dog", "apple", "pear", "saw", "drill", "kind", "is", "?"]
    backend = Tokenizer(models.WordLevel(vocab={word: i for i, word in enumerate(words)}, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>",
                                        eos_token="<eos>")
    assert len(tokenizer) == 15
    config = Qwen2Config(vocab_size=15, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, pad_token_id=0, bos_token_id=1,
                         eos_token_id=2)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def write_data(path: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """Rows {question, label, id}: 'NOUN FILLER FILLER kind ?' -> the noun's class."""
    rows = [{"id": f"{noun}-{a}-{b}", "question": f"{noun} {a} {b} kind ?", "label": label}
            for label, nouns in LABELS.items() for noun in nouns for a in FILLERS for b in FILLERS]
    random.Random(seed).shuffle(rows)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def experiment(folder: pathlib.Path, run_dir: pathlib.Path, **training) -> dict:
    """The experiment file's content for the project in `folder`."""
    return {
        "seed": 0,
        "run_dir": str(run_dir),
        "model": {"path": "model"},
        "data": {"train": {"path": "data.jsonl"}, "num_eval": 48, "prompt_field": "question",
                 "answer_field": "label", "id_field": "id"},
        "reward": {"function": "my_reward:first_word", "args": {"bonus": 1.0}},
        "training": {"group_size": 8, "groups_per_batch": 4, "max_staleness": 1, "lr": 3e-3, "max_tokens": 2,
                     "time_budget_s": 60, "max_steps": 200, "concurrency": 8, **training},
        "evaluation": {"every_s": 20},
        "checkpoint": {"interval": 5},
    }


def write_project(folder: pathlib.Path, run_dir: pathlib.Path, **training) -> pathlib.Path:
    """Model, data, reward module and experiment file in `folder`; returns the experiment file."""
    import yaml

    folder.mkdir(parents=True, exist_ok=True)
    write_model(folder / "model")
    write_data(folder / "data.jsonl")
    (folder / "my_reward.py").write_text(REWARD_MODULE)
    path = folder / "experiment.yaml"
    path.write_text(yaml.safe_dump(experiment(folder, run_dir, **training), sort_keys=False))
    return path
