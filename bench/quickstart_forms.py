"""Is `relayrl run` (the shipped experiment file) as fast as the `--config deploy/quickstart.yaml` job?

Both forms run the same RL phase (deploy/pipeline.py) on the same prompts; this runs them in pairs, back to back,
alternating which goes first, from one SFT checkpoint (made once by the first run's SFT, then `start_checkpoint`
for the --config form and `model.path` with `sft.steps=0` for the experiment file), each with the same RL budget.
It prints each run's optimizer steps and completions, and per pair the ratio experiment / --config of steps: the
baseline is measured in the same invocation, next to it. On a 2-core machine shared with other work the ratio of
one pair moves by 10-20%; read the mean over pairs.

    python bench/quickstart_forms.py [--pairs 2] [--budget-s 120] [--sft-steps 450 | --checkpoint DIR]
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent


def relayrl_run(folder: pathlib.Path, args: list[str]) -> pathlib.Path:
    """`relayrl run ARGS` in `folder`; returns its run folder (runs/quickstart). The --config job exits 1 when
    the held-out accuracy did not rise, which a short run may not: a finished run is one with its summary."""
    folder.mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(folder / "out.log", "w") as log:
        subprocess.run([sys.executable, "-m", "deploy.cli", "run", *args], cwd=folder, env=env, stdout=log,
                       stderr=subprocess.STDOUT, check=False)
    run = folder / "runs" / "quickstart"
    if not (run / "summary.json").is_file():
        raise SystemExit(f"relayrl run {' '.join(args)} did not finish: see {folder / 'out.log'}")
    return run


def counts(run: pathlib.Path) -> tuple[int, int]:
    """(optimizer steps, completions generated) of a finished run."""
    summary = json.loads((run / "summary.json").read_text())
    return summary["steps"], summary["completions"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=120.0, help="RL wall-clock budget of each run")
    parser.add_argument("--sft-steps", type=int, default=450)
    parser.add_argument("--checkpoint", type=pathlib.Path, help="an SFT checkpoint to start from (no SFT run)")
    args = parser.parse_args()

    work = pathlib.Path(tempfile.mkdtemp(prefix="quickstart-forms-"))
    checkpoint = args.checkpoint or relayrl_run(work / "sft", ["--set", f"sft.steps={args.sft_steps}", "--set",
                                                               "training.time_budget_s=1"]) / "model-sft"
    forms = {
        "--config": ["--config", str(ROOT / "deploy" / "quickstart.yaml"), "--set", f"start_checkpoint={checkpoint}",
                     "--set", f"rl.time_budget_s={args.budget_s}"],
        "experiment": ["--set", "sft.steps=0", "--set", f"model.path={checkpoint}",
                       "--set", f"training.time_budget_s={args.budget_s}"],
    }
    ratios = []
    for pair in range(args.pairs):
        order = list(forms) if pair % 2 == 0 else list(forms)[::-1]
        steps = {}
        for form in order:
            steps[form], completions = counts(relayrl_run(work / f"pair{pair}-{form.strip('-')}", forms[form]))
            print(f"pair {pair} {form:>10}: {steps[form]} steps, {completions} completions in {args.budget_s:.0f} s",
                  flush=True)
        ratios.append(steps["experiment"] / steps["--config"])
        print(f"pair {pair}: experiment / --config steps = {ratios[-1]:.3f}", flush=True)
    print(f"mean over {len(ratios)} pairs: experiment / --config steps = {sum(ratios) / len(ratios):.3f} "
          f"(runs in {work})")


if __name__ == "__main__":
    main()
