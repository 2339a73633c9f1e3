"""The reward model: a tiny sequence classifier built in code, scored in batches."""

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from protos.sample import Sample
from reward.model import reward_model
from rollout.model.tiny import char_tokenizer


def write_tiny_reward_model(path, num_labels: int = 1):
    """A 1-layer Qwen2 classifier with the char tokenizer (pad id 0), saved as an HF folder."""
    tokenizer = char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=num_labels,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def text_sample(prompt: str, response: str) -> Sample:
    empty = np.zeros(0)
    return Sample("s0", "p0", empty.astype("int32"), empty.astype("int32"), empty.astype("uint8"),
                  empty.astype("float32"), empty.astype("int64"), prompt_text=prompt, response_text=response)


SAMPLES = [text_sample("1+1=", "2"), text_sample("1+1=", "3"), text_sample("Say hi. ", "hello there, friend"),
           text_sample("", "x")]


@pytest.fixture(scope="module")
def scalar_model(tmp_path_factory):
    return write_tiny_reward_model(tmp_path_factory.mktemp("rm") / "scalar")


def test_batched_scores_equal_one_by_one(scalar_model):
    torch.set_num_threads(1)
    batched = reward_model(SAMPLES, path=scalar_model, batch_size=3)
    single = [reward_model([s], path=scalar_model, batch_size=1)[0] for s in SAMPLES]
    assert [o.score for o in batched] == pytest.approx([o.score for o in single], abs=1e-5)
    assert len({round(o.score, 6) for o in batched}) == len(SAMPLES)  # different texts, different scores
    assert batched[0].details == {"rm_logit": batched[0].score}


def test_truncation_keeps_the_end(scalar_model):
    long = text_sample("x" * 300, "answer")
    cut = reward_model([long], path=scalar_model, max_length=16)[0].score
    tail = reward_model([text_sample("x" * 10, "answer")], path=scalar_model)[0].score
    assert cut == pytest.approx(tail, abs=1e-5)


def test_classifier_scores_are_probabilities(tmp_path):
    path = write_tiny_reward_model(tmp_path / "cls", num_labels=2)
    outs = reward_model(SAMPLES, path=path, batch_size=2)
    assert all(0.0 < o.score < 1.0 and o.details["rm_prob"] == o.score for o in outs)
    first = reward_model(SAMPLES, path=path, label=0)
    assert [a.score + b.score for a, b in zip(outs, first)] == pytest.approx([1.0] * len(SAMPLES), abs=1e-6)
    with pytest.raises(ValueError, match="out of range"):
        reward_model(SAMPLES, path=path, label=2)
