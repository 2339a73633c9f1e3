"""`python -m trainer --config FILE --set key=value` — also under `torchrun --nproc_per_node N -m trainer ...`.

Parses and validates the config before any heavy import, then calls one function.
"""

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m trainer", description="Train a policy from the replay buffer.")
    parser.add_argument("--config", help="YAML config file (trainer.config.TrainerConfig)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set algorithm.name=grpo (repeatable)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from services.config import ConfigError, load_config
    from trainer.config import TrainerConfig

    try:
        config = load_config(TrainerConfig, args.config, args.set)
    except ConfigError as exc:
        print(f"trainer: {exc}", file=sys.stderr)
        return 2
    from services.teardown import skip_final_collection
    from trainer.run import run

    try:
        run(config)
    finally:
        skip_final_collection()
    return 0


if __name__ == "__main__":
    sys.exit(main())
