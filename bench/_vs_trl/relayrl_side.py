"""The relayrl half of bench/vs_trl.py: the quickstart experiment's asynchronous GRPO from a given checkpoint.

Run as its own process, like the TRL half:

    PYTHONPATH=bench python -m _vs_trl.relayrl_side --out summary.json --seed 0 --num-eval 500 \
        --set model.path=DIR --set sft.steps=0 ...

It writes the quickstart's project beside --out (deploy/experiment/quickstart.py: every 2-digit addition, --num-eval
held out by a shuffle seeded with --seed, as the TRL half splits them) and runs its experiment file
(deploy/experiment/quickstart_experiment.yaml) with `--set` overrides of its fields (deploy/experiment/schema.py). The run's clock
starts when the trainer and driver processes are launched (services are already up) and keeps running through its
held-out evaluations, which go through the rollout service while training goes on.
"""

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where the run's summary goes (JSON)")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed and the held-out split's")
    parser.add_argument("--num-eval", type=int, default=200, help="held-out prompts, every one evaluated")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="experiment file field")
    args = parser.parse_args()

    from rich.console import Console

    from deploy.experiment.quickstart import write_project
    from deploy.experiment.schema import load_experiment
    from deploy.runs.experiment_run import run_experiment

    out = Path(args.out)
    experiment = write_project(out.parent / "quickstart-project", seed=args.seed, num_eval=args.num_eval)
    config = load_experiment(experiment, [f"seed={args.seed}", f"data.num_eval={args.num_eval}", *args.set])
    # The run's live table is for a terminal; here it goes to a log beside the summary.
    with open(out.with_suffix(".console.log"), "w") as console_log:
        summary = run_experiment(config, console=Console(file=console_log, width=120))
    out.write_text(json.dumps({"system": "relayrl quickstart", "config": config.model_dump(mode="json"),
                               **asdict(summary)}, indent=1))


if __name__ == "__main__":
    main()
