"""The arithmetic task as both sides of a learning-speed benchmark see it.

One split of the prompts, one encoding (`[bos] + chars(prompt)` -> `chars(answer) + [eos]`), one
correctness rule (relayrl's `exact_match` normalisation on the text before the first eos) and one
greedy held-out evaluator, so that a number printed for relayrl and one printed for a baseline mean
the same thing.
"""

from collections import defaultdict
from dataclasses import dataclass

import torch

from deploy.experiment.tasks import Task, arithmetic_tasks, split_tasks
from reward.match import extract_answer, normalize


@dataclass(frozen=True)
class TaskSpec:
    """Which prompts exist and which are held out (the same on every side)."""

    # Operands have this many digits at most ("37+45=" for 2).
    digits: int = 2
    op: str = "+"
    # Prompts never trained on; held-out accuracy is greedy exact match over them.
    num_eval: int = 500
    # Seed of the train / held-out shuffle.
    split_seed: int = 0

    def split(self) -> tuple[list[Task], list[Task]]:
        return split_tasks(arithmetic_tasks(self.digits, self.op), self.num_eval, self.split_seed)


def is_correct(text: str, answer: str) -> bool:
    """relayrl's exact_match rule: the extracted, normalised response equals the answer."""
    return normalize(extract_answer(text)) == normalize(answer)


def completion_text(tokenizer, token_ids: list[int]) -> str:
    """The response text: tokens before the first eos, special tokens dropped."""
    eos = tokenizer.eos_token_id
    if eos in token_ids:
        token_ids = token_ids[: token_ids.index(eos)]
    return tokenizer.decode(token_ids, skip_special_tokens=True)


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer(prompt, add_special_tokens=False)["input_ids"]]


@torch.no_grad()
def greedy_accuracy(model, tokenizer, tasks: list[Task], max_new_tokens: int) -> float:
    """Held-out greedy exact match, prompts batched by length (no padding, so nothing to mask)."""
    was_training = model.training
    model.eval()
    by_length: dict[int, list[tuple[list[int], str]]] = defaultdict(list)
    for task in tasks:
        ids = prompt_ids(tokenizer, task.prompt)
        by_length[len(ids)].append((ids, task.answer))
    correct = 0
    for length, group in by_length.items():
        input_ids = torch.tensor([ids for ids, _ in group], device=model.device)
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        for row, (_, answer) in zip(output[:, length:].tolist(), group, strict=True):
            correct += is_correct(completion_text(tokenizer, row), answer)
    model.train(was_training)
    return correct / len(tasks)
