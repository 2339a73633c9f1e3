"""Verifiable tasks generated in code: multi-digit arithmetic with an exact answer."""

import json
import pathlib
import random
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Task:
    """One prompt with its reference answer (what the exact-match reward checks)."""

    prompt_id: str
    prompt: str
    answer: str
    metadata: dict = field(default_factory=dict)


def arithmetic_tasks(digits: int = 2, op: str = "+") -> list[Task]:
    """Every `a op b` with a, b in [0, 10**digits), as 'a+b=' -> str(result). Deterministic order."""
    if op not in "+-*":
        raise ValueError(f"op must be one of + - *, got {op!r}")
    fn = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}[op]
    top = 10**digits
    return [
        Task(prompt_id=f"{a}{op}{b}", prompt=f"{a}{op}{b}=", answer=str(fn(a, b)))
        for a in range(top)
        for b in range(top)
    ]


def split_tasks(tasks: list[Task], num_eval: int, seed: int) -> tuple[list[Task], list[Task]]:
    """A seeded shuffle into (train, held-out eval); the two never share a prompt."""
    order = list(tasks)
    random.Random(seed).shuffle(order)
    return order[num_eval:], order[:num_eval]


def write_jsonl(tasks: list[Task], path: pathlib.Path) -> pathlib.Path:
    """The prompt-dataset format the rollout driver reads: prompt_id, prompt, metadata.answer."""
    with open(path, "w") as out:
        for task in tasks:
            row = asdict(task)
            row["metadata"] = {**task.metadata, "answer": task.answer}
            out.write(json.dumps({k: row[k] for k in ("prompt_id", "prompt", "metadata")}) + "\n")
    return path
