"""Writes the MOPD example's data beside this file (`python examples/algorithms/data/make_domains.py`): rows
{prompt_id, prompt: "12-34=", answer: "-22", domain}, the quickstart's seeded split (deploy.experiment.tasks.split_tasks, seed
0, 200 held out) applied to every 2-digit subtraction and addition.

    sub_train.jsonl, sub_eval.jsonl          every subtraction, 200 held out: grpo_sub.yaml's data (no domain field)
    domains_train.jsonl, domains_eval.jsonl  mopd.yaml's: the first 1,000 train rows of addition then of subtraction,
                                             and the first 100 held-out rows of each; domain add / sub
"""

import json
import pathlib

from deploy.experiment.tasks import Task, arithmetic_tasks, split_tasks

EVAL, SEED = 200, 0
DOMAIN_TRAIN, DOMAIN_EVAL = 1000, 100


def rows(tasks: list[Task], domain: str | None = None) -> str:
    extra = {"domain": domain} if domain else {}
    return "".join(json.dumps({"prompt_id": t.prompt_id, "prompt": t.prompt, "answer": t.answer, **extra}) + "\n"
                   for t in tasks)


def main() -> None:
    folder = pathlib.Path(__file__).parent
    add_train, add_eval = split_tasks(arithmetic_tasks(2, "+"), EVAL, SEED)
    sub_train, sub_eval = split_tasks(arithmetic_tasks(2, "-"), EVAL, SEED)
    (folder / "sub_train.jsonl").write_text(rows(sub_train))
    (folder / "sub_eval.jsonl").write_text(rows(sub_eval))
    (folder / "domains_train.jsonl").write_text(rows(add_train[:DOMAIN_TRAIN], "add")
                                                + rows(sub_train[:DOMAIN_TRAIN], "sub"))
    (folder / "domains_eval.jsonl").write_text(rows(add_eval[:DOMAIN_EVAL], "add") + rows(sub_eval[:DOMAIN_EVAL], "sub"))


if __name__ == "__main__":
    main()
