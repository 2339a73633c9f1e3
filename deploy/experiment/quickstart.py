"""The quickstart's project, written the way a user would lay out their own (`relayrl run` with no argument).

    runs/quickstart-project/
        model/            a tiny Qwen2 built in code (rollout.model.tiny) with its character tokenizer
        train.jsonl       every 2-digit addition {prompt_id, prompt: "12+34=", answer: "46"} but the held-out ones
        eval.jsonl        200 held out by a seeded shuffle (deploy.experiment.tasks.split_tasks)
        experiment.yaml   a copy of the shipped deploy/experiment/quickstart_experiment.yaml

which `relayrl run` then runs like any other experiment file (deploy/runs/experiment_run.py: run_quickstart). The project is written once and kept.
"""

import json
import pathlib
import shutil

SHIPPED = pathlib.Path(__file__).with_name("quickstart_experiment.yaml")
DEFAULT_FOLDER = pathlib.Path("runs") / "quickstart-project"


def write_project(folder: pathlib.Path, seed: int = 0, num_eval: int = 200) -> pathlib.Path:
    """Model, data and the experiment file in `folder` (kept when already whole); returns the experiment file."""
    from rollout.model.tiny import write_tiny_model

    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "model" / "config.json").is_file():
        staging = folder / ".model-staging"
        shutil.rmtree(staging, ignore_errors=True)
        write_tiny_model(staging, seed=seed)  # deploy.experiment.tiny_model.ModelConfig's defaults
        staging.rename(folder / "model")
    write_data(folder, seed, num_eval)
    experiment = folder / "experiment.yaml"
    if not experiment.exists():
        shutil.copyfile(SHIPPED, experiment)
    return experiment


def write_data(folder: pathlib.Path, seed: int = 0, num_eval: int = 200) -> None:
    """train.jsonl and eval.jsonl in `folder`: every 2-digit addition {prompt_id, prompt, answer}, `num_eval` of them
    held out by a seeded shuffle. examples/algorithms/data/ ships this split (seed 0, 200 held out)."""
    from deploy.experiment.tasks import arithmetic_tasks, split_tasks

    train, held_out = split_tasks(arithmetic_tasks(2, "+"), num_eval, seed)
    for name, tasks in (("train.jsonl", train), ("eval.jsonl", held_out)):
        rows = "".join(json.dumps({"prompt_id": t.prompt_id, "prompt": t.prompt, "answer": t.answer}) + "\n"
                       for t in tasks)
        (folder / name).write_text(rows)

