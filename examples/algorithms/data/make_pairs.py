"""Writes the DPO examples' data beside this file (`python examples/algorithms/data/make_pairs.py`): preference pairs
of the quickstart's 2-digit addition, {prompt_id, prompt: "12+34=", chosen: "46", rejected: "49"}.

    pairs_train.jsonl  the first 2,000 prompts of the quickstart's train split (deploy.experiment.tasks.split_tasks, seed 0)
    pairs_eval.jsonl   its 200 held-out prompts

chosen is the sum; rejected a near miss, the sum moved by 1 to 10 (never below 0), drawn with random.Random(0).
"""

import json
import pathlib
import random

from deploy.experiment.tasks import arithmetic_tasks, split_tasks

TRAIN_PAIRS, EVAL_PAIRS, SEED = 2000, 200, 0


def near_miss(answer: str, rng: random.Random) -> str:
    right = int(answer)
    return str(rng.choice([right + d for d in range(-10, 11) if d and right + d >= 0]))


def main() -> None:
    train, held_out = split_tasks(arithmetic_tasks(2, "+"), EVAL_PAIRS, SEED)
    rng = random.Random(SEED)
    folder = pathlib.Path(__file__).parent
    for name, tasks in (("pairs_train.jsonl", train[:TRAIN_PAIRS]), ("pairs_eval.jsonl", held_out)):
        rows = [{"prompt_id": t.prompt_id, "prompt": t.prompt, "chosen": t.answer,
                 "rejected": near_miss(t.answer, rng)} for t in tasks]
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    main()
