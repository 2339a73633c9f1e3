"""Reward model: a sequence-classification transformers model from a local folder, scored in batches."""

import functools

import torch
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from protos.sample import Sample
from reward.registry import RewardOutput


@functools.lru_cache(maxsize=4)
def load_reward_model(path: str, device: str = "cpu") -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load once per process (workers keep it between calls); never downloads (local folders only)."""
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).to(device).eval()
    # The classifier reads the last non-pad token; it needs to know which id is padding.
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def prepare(*, path: str, device: str = "cpu", **_: object) -> None:
    """Load the model ahead of scoring (the registry's prepare hook for reward models)."""
    load_reward_model(path, device)


@torch.inference_mode()
def reward_model(
    samples: list[Sample],
    *,
    path: str,
    batch_size: int = 8,
    max_length: int = 1024,
    label: int = -1,
    device: str = "cpu",
) -> list[RewardOutput]:
    """Score prompt_text + response_text with the model at `path`.

    With one output label the score is its logit; with several, the softmax probability of
    `label` (default the last, e.g. "good" in a bad/good classifier). Texts longer than
    `max_length` tokens keep their end (where the response is).
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be > 0, got {batch_size}")
    model, tokenizer = load_reward_model(path, device)
    num_labels = model.config.num_labels
    if not -num_labels <= label < num_labels:
        raise ValueError(f"label {label} out of range for a model with {num_labels} labels")
    tokenizer.truncation_side = "left"
    outputs: list[RewardOutput] = []
    for start in range(0, len(samples), batch_size):
        texts = [s.prompt_text + s.response_text for s in samples[start:start + batch_size]]
        batch = tokenizer(texts, padding=True, truncation=True, max_length=max_length,
                          return_tensors="pt", add_special_tokens=False).to(device)
        logits = model(**batch).logits.float()
        for row in logits:
            if num_labels == 1:
                outputs.append(RewardOutput(row[0].item(), {"rm_logit": row[0].item()}))
            else:
                prob = torch.softmax(row, dim=-1)[label].item()
                outputs.append(RewardOutput(prob, {"rm_prob": prob, "rm_logit": row[label].item()}))
    return outputs
