"""What tests/test_families.py measures with, in process: held-out greedy accuracy of an HF model, (correct,
wrong) answer pairs for DPO, and windows of a metrics file.

Accuracy is the examples' held-out metric (their exact_match reward, reward/match.py, of greedy completions: on
these digit answers, the answer stripped equals the reference), taken here with transformers' generate so no service
has to start for an offline family.
"""

import json
import random
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from deploy.experiment.tasks import Task
from deploy.runs.offline import preference_pair
from protos.sample import Sample


def prompt_ids(tokenizer, task: Task) -> list[int]:
    return [tokenizer.bos_token_id, *tokenizer.encode(task.prompt, add_special_tokens=False)]


def answer_ids(tokenizer, answer: str) -> list[int]:
    return [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]


@torch.no_grad()
def greedy_answers(model, tokenizer, tasks: list[Task], max_tokens: int = 4) -> list[str]:
    """Each task's greedy answer (text before eos, stripped); prompts batched by length (no padding)."""
    by_length: dict[int, list[int]] = defaultdict(list)
    for index, task in enumerate(tasks):
        by_length[len(prompt_ids(tokenizer, task))].append(index)
    answers = [""] * len(tasks)
    for length, indices in by_length.items():
        input_ids = torch.tensor([prompt_ids(tokenizer, tasks[i]) for i in indices])
        output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=max_tokens, eos_token_id=tokenizer.eos_token_id,
                                pad_token_id=tokenizer.pad_token_id)
        for index, row in zip(indices, output[:, length:].tolist(), strict=True):
            row = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
            answers[index] = tokenizer.decode(row, skip_special_tokens=True).strip()
    return answers


def greedy_accuracy(model, tokenizer, tasks: list[Task], max_tokens: int = 4) -> float:
    """Held-out greedy exact match."""
    answers = greedy_answers(model, tokenizer, tasks, max_tokens)
    return sum(answer == task.answer for answer, task in zip(answers, tasks, strict=True)) / len(tasks)


def near_miss(task: Task, rng: random.Random) -> str:
    """A wrong answer close to the right one: moved by 1-10 (never below 0)."""
    right = int(task.answer)
    return str(rng.choice([right + d for d in range(-10, 11) if d and right + d >= 0]))


def preference_pairs(model, tokenizer, tasks: list[Task], seed: int) -> tuple[list[Sample], list[tuple[Task, str]]]:
    """DPO data made in code: per task a group of two samples (deploy.runs.offline.preference_pair), the correct
    answer (chosen) against the model's own greedy answer where that is wrong, else a near miss (rejected).
    Returns the samples and each task's rejected answer."""
    rng = random.Random(seed)
    samples, rejected = [], []
    for task, greedy in zip(tasks, greedy_answers(model, tokenizer, tasks), strict=True):
        wrong = greedy if greedy != task.answer else near_miss(task, rng)
        rejected.append((task, wrong))
        samples += preference_pair(task.prompt_id, prompt_ids(tokenizer, task), answer_ids(tokenizer, task.answer),
                                   answer_ids(tokenizer, wrong))
    return samples, rejected


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def windows(steps: list[dict], key: str, fraction: float = 0.25) -> tuple[float, float]:
    """Mean of `key` over the first and the last `fraction` of the steps."""
    width = max(1, int(len(steps) * fraction))
    return statistics.mean(s[key] for s in steps[:width]), statistics.mean(s[key] for s in steps[-width:])


@torch.no_grad()
def greedy_image_accuracy(model_dir: Path, rows, images: list[bytes] | None = None, max_tokens: int = 2) -> float:
    """Held-out greedy exact match of a vision-language model folder on experiment rows (deploy.experiment.data.
    PromptRow, one image each), with transformers' generate: the prompt as the driver tokenizes it, its image run
    expanded as the rollout expands it. `images` replaces the rows' images (encoded bytes, one per row)."""
    import base64

    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from deploy.experiment.data import prompt_ids
    from protos.rollout_pb2 import ImagePart
    from rollout.serve.config import ImageSettings
    from rollout.serve.images import ImageReader

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    reader = ImageReader(str(model_dir), ImageSettings())
    images = images or [base64.b64decode(row.images[0]) for row in rows]
    by_length: dict[int, list[tuple[int, list[int], object]]] = defaultdict(list)
    for index, (row, image) in enumerate(zip(rows, images, strict=True)):
        (read,) = reader.read([ImagePart(data=image)])
        ids = reader.expand(prompt_ids(row, tokenizer, True), [read])
        by_length[len(ids)].append((index, ids, read))
    right = 0
    for group in by_length.values():
        input_ids = torch.tensor([ids for _, ids, _ in group])
        pixels = torch.cat([torch.as_tensor(read.image.pixel_values) for _, _, read in group])
        grids = torch.tensor([list(read.image.grid_thw) for _, _, read in group])
        output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), pixel_values=pixels,
                                image_grid_thw=grids, do_sample=False, max_new_tokens=max_tokens,
                                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        for (index, _, _), completion in zip(group, output[:, input_ids.shape[1]:].tolist(), strict=True):
            if tokenizer.eos_token_id in completion:
                completion = completion[: completion.index(tokenizer.eos_token_id)]
            right += tokenizer.decode(completion, skip_special_tokens=True).strip() == rows[index].metadata["answer"]
    return right / len(rows)
