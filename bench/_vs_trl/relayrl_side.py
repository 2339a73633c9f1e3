"""The relayrl half of bench/vs_trl.py: the quickstart's asynchronous GRPO from a given checkpoint.

Run as its own process, like the TRL half:

    PYTHONPATH=bench python -m _vs_trl.relayrl_side --out summary.json --set start_checkpoint=DIR ...

`--set` takes the quickstart's own config fields (deploy/quickstart.py, QuickstartConfig) on top of
the shipped deploy/quickstart.yaml. The quickstart's clock starts when the trainer and driver
processes are launched (services are already up) and keeps running through its held-out
evaluations, which go through the rollout service while training goes on.
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
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="quickstart config field")
    args = parser.parse_args()

    from rich.console import Console

    from deploy.quickstart import DEFAULT_CONFIG, QuickstartConfig, run_quickstart
    from services.config import load_config

    config = load_config(QuickstartConfig, DEFAULT_CONFIG, args.set)
    out = Path(args.out)
    # The quickstart's live table is for a terminal; here it goes to a log beside the summary.
    with open(out.with_suffix(".console.log"), "w") as console_log:
        summary = run_quickstart(config, console=Console(file=console_log, width=120))
    out.write_text(json.dumps({"system": "relayrl quickstart", "config": config.model_dump(), **asdict(summary)},
                              indent=1))


if __name__ == "__main__":
    main()
