"""relayrl side by side with Hugging Face TRL's GRPOTrainer: learning speed on one CPU machine.

Both systems train the same seeded tiny Qwen2 from the same SFT checkpoint on 2-digit addition
(exact-match reward, 8 prompts x 8 completions per step, the same learning rate, temperature,
completion length, seed and wall-clock budget), one after the other in this run, each in its own
process. Reported for both: held-out greedy exact match over time, time to 0.8 and 0.9 (the first
evaluation at or above, and "held": the first time the mean of the last 3 evaluations is), final
accuracy, completions/s.

The clock: wall time of the training phase with held-out evaluation counted in, for both. TRL's
starts when `trainer.train()` begins and pauses training while it evaluates; relayrl's starts when
its trainer and driver processes are launched (their imports and model loads count against it)
and its evaluations run through the rollout service while training continues.

Choices made for the baseline: TRL keeps its defaults (DAPO token-level loss, group-std reward
scaling, no KL) except bf16=False, gradient_checkpointing=False, a constant learning rate and the
batch above. relayrl uses the same loss (token-level mean, group-std advantages, clip 0.2, no KL,
gradient norm clipped at 1) and, being asynchronous, trains on samples up to --max-staleness policy
versions old (default 1, as the quickstart), with the PPO ratio taken against the logprobs of the
policy that sampled them (the clipped importance ratio is the off-policy correction); TRL is
on-policy. Both sides run at --lr 1e-4: from this SFT start 3e-4 first collapsed held-out accuracy
in both systems (TRL 0.34 -> 0.03 within 45 s), 3e-5 learned more slowly.

TRL's torch threads (--trl-threads auto, the default) are chosen by a probe in the same run: a short
TRL run at 1, 2, 4, ... threads up to the number of cores, the fastest in completions/s wins. On a
quiet 2-core machine that is 2 threads (1,802 completions/s against 1,421 with one, 20 s each); on a
loaded one it has been 1. relayrl runs one torch thread per process (its trainer with 2 made fewer
completions/s: its processes share the cores).

    python bench/vs_trl.py            # 600 s each (about 25 minutes in all)
    python bench/vs_trl.py --quick    # 60 s each: a smoke test

Needs the `bench` extra (pip install -e '.[bench]').
"""

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
THRESHOLDS = (0.8, 0.9)
SUSTAINED = 3  # evaluations averaged for the "held" times
BASELINE = "TRL GRPOTrainer"


@dataclass(frozen=True)
class Run:
    """One system's curve: points of {elapsed_s, accuracy, completions}, oldest first."""

    name: str
    curve: list[dict]
    completions: int
    seconds: float
    # From the start of the clock to the first generated completions (process start-up, model
    # loads, first weight sync): what a longer budget amortises.
    startup_s: float
    # Extra lines for the report (relayrl: where its trainer's time went, staleness).
    notes: tuple[str, ...] = ()

    def time_to(self, accuracy: float) -> float | None:
        return next((p["elapsed_s"] for p in self.curve if p["accuracy"] >= accuracy), None)

    def time_held(self, accuracy: float, evals: int = SUSTAINED) -> float | None:
        """The first time the mean of the last `evals` evaluations reaches `accuracy`: one lucky (or unlucky)
        evaluation of 200 prompts moves a first crossing by whole evaluation intervals."""
        points = self.curve
        return next((points[i]["elapsed_s"] for i in range(evals - 1, len(points))
                     if sum(p["accuracy"] for p in points[i - evals + 1:i + 1]) / evals >= accuracy), None)

    def accuracy_near(self, elapsed: float) -> float:
        """The evaluation closest in time to `elapsed`."""
        return min(self.curve, key=lambda p: abs(p["elapsed_s"] - elapsed))["accuracy"]

    def accuracy_at_step(self, step: int) -> float:
        """The evaluation closest to optimizer step `step` (learning per step, whatever the speed)."""
        return min(self.curve, key=lambda p: abs(p["step"] - step))["accuracy"]

    @property
    def steps(self) -> int:
        return self.curve[-1]["step"]

    @property
    def final_accuracy(self) -> float:
        return self.curve[-1]["accuracy"]

    @property
    def completions_per_s(self) -> float:
        return self.completions / self.seconds

    @property
    def steady_completions_per_s(self) -> float:
        return self.completions / max(self.seconds - self.startup_s, 1e-9)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="60 s budget each, evaluations every 10 s")
    parser.add_argument("--budget-s", type=float, default=600.0, help="wall-clock budget of each training run")
    parser.add_argument("--eval-every-s", type=float, default=30.0, help="held-out evaluation interval")
    parser.add_argument("--seed", type=int, default=0, help="model init, task split, sampling and training")
    parser.add_argument("--lr", type=float, default=1e-4, help="RL learning rate of both systems")
    parser.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up of both systems")
    parser.add_argument("--num-eval", type=int, default=200, help="held-out prompts")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="longest completion (3 digits + eos)")
    parser.add_argument("--sft-target", type=float, default=0.3, help="held-out accuracy the SFT warm-up stops at")
    parser.add_argument("--max-staleness", type=int, default=1,
                        help="relayrl: policy versions generation may run ahead of training (TRL is on-policy)")
    parser.add_argument("--trl-threads", default="auto",
                        help="torch threads of the TRL process; auto = the fastest in a short probe of 1, 2, 4, .. cores")
    parser.add_argument("--probe-s", type=float, default=20.0, help="length of each TRL thread probe run")
    parser.add_argument("--only", choices=("trl", "relayrl"), help="run one side (development)")
    parser.add_argument("--workdir", default=str(REPO / "runs" / "vs_trl"), help="checkpoints, logs, curves")
    args = parser.parse_args()
    if args.quick:
        args.budget_s, args.eval_every_s, args.probe_s = 60.0, 10.0, 10.0
    return args


def _subprocess(argv: list[str], log_path: Path, timeout_s: float, points: Path, label: str) -> None:
    """Run one side in its own process, its output in a log; echo each evaluation it appends to `points`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(BENCH), str(REPO), os.environ.get("PYTHONPATH", "")])}
    points.unlink(missing_ok=True)
    shown = 0
    deadline = time.monotonic() + timeout_s
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        while True:
            finished = proc.poll() is not None
            for point in _read_points(points)[shown:]:
                print(f"  {label} {point['elapsed_s']:6.0f} s  held-out {point['accuracy']:.3f}  "
                      f"completions {point['completions']}", flush=True)
                shown += 1
            if finished:
                break
            if time.monotonic() > deadline:
                proc.kill()
                proc.wait(10)
                raise TimeoutError(f"{' '.join(argv[:2])} ran past {timeout_s:.0f} s; see {log_path}")
            time.sleep(1.0)
    if proc.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{' '.join(argv[:2])} exited with code {proc.returncode}; last lines of {log_path}:\n{tail}")


def _read_points(path: Path) -> list[dict]:
    """The complete lines of a JSONL file another process appends to."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def _trl_argv(args: argparse.Namespace, start: Path, out: Path, budget_s: float, eval_every_s: float,
              threads: int) -> list[str]:
    return ["-m", "_vs_trl.trl_side", "--model", str(start), "--out", str(out), "--budget-s", str(budget_s),
            "--eval-every-s", str(eval_every_s), "--seed", str(args.seed), "--lr", str(args.lr),
            "--warmup-steps", str(args.warmup_steps), "--max-new-tokens", str(args.max_new_tokens),
            "--threads", str(threads), "--num-eval", str(args.num_eval), "--split-seed", str(args.seed)]


def trl_threads(args: argparse.Namespace, start: Path, workdir: Path) -> int:
    """--trl-threads, or for `auto` the thread count at which a short TRL run makes the most completions/s."""
    if args.trl_threads != "auto":
        return int(args.trl_threads)
    speeds = {}
    cores = os.cpu_count() or 1
    for threads in sorted({*(2**k for k in range(cores.bit_length()) if 2**k <= cores), cores}):
        out = workdir / f"trl_probe_{threads}.json"
        _subprocess(_trl_argv(args, start, out, args.probe_s, 10 * args.probe_s, threads),
                    workdir / f"trl_probe_{threads}.log", timeout_s=args.probe_s + 300,
                    points=out.with_suffix(".points.jsonl"), label=f"TRL probe {threads}t")
        result = json.loads(out.read_text())
        speeds[threads] = result["completions"] / max(result["train_s"], 1e-9)
    best = max(speeds, key=speeds.get)
    shown = ", ".join(f"{t} thread{'s' if t > 1 else ''} {s:.0f}/s" for t, s in speeds.items())
    print(f"TRL thread probe ({args.probe_s:.0f} s each, completions/s): {shown} -> {best}", flush=True)
    return best


def run_trl(args: argparse.Namespace, start: Path, workdir: Path, threads: int) -> Run:
    out = workdir / "trl.json"
    _subprocess(_trl_argv(args, start, out, args.budget_s, args.eval_every_s, threads),
                workdir / "trl.log", timeout_s=args.budget_s + 300, points=out.with_suffix(".points.jsonl"), label="TRL")
    result = json.loads(out.read_text())
    return Run(result["system"], result["curve"], result["completions"], result["train_s"], result["first_step_s"],
               (f"TRL ran {threads} torch thread{'s' if threads > 1 else ''}",))


def run_relayrl(args: argparse.Namespace, start: Path, workdir: Path) -> Run:
    out = workdir / "relayrl.json"
    overrides = {  # the quickstart experiment's fields (deploy/experiment/quickstart_experiment.yaml)
        "run_dir": workdir / "relayrl",
        "model.path": start,
        "sft.steps": 0,
        "training.time_budget_s": args.budget_s,
        "evaluation.every_s": args.eval_every_s,
        "training.lr": args.lr,
        "training.warmup_steps": args.warmup_steps,
        "training.max_tokens": args.max_new_tokens,
        "training.group_size": 8,
        "training.groups_per_batch": 8,
        "training.temperature": 1.0,
        "training.max_staleness": args.max_staleness,
        # TRL's default loss (`dapo`): token-level mean over the batch, group-std-scaled advantages.
        "algorithm.loss_agg": "token_mean",
        "checkpoint.export_dir": "null",  # no Hugging Face export after the run: nothing here reads it
    }
    argv = ["-m", "_vs_trl.relayrl_side", "--out", str(out), "--seed", str(args.seed), "--num-eval", str(args.num_eval)]
    for key, value in overrides.items():
        argv += ["--set", f"{key}={value}"]
    _subprocess(argv, workdir / "relayrl.log", timeout_s=args.budget_s + 300,
                points=workdir / "relayrl" / "metrics.jsonl", label="relayrl")
    result = json.loads(out.read_text())
    run_dir = Path(result["run_dir"])
    return Run(result["system"], result["curve"], result["completions"], result["rl_seconds"],
               _relayrl_startup_s(run_dir), _relayrl_notes(run_dir, result["rl_seconds"]))


def _relayrl_notes(run_dir: Path, seconds: float) -> tuple[str, ...]:
    """Where the trainer's wall-clock went, and how stale its batches were."""
    steps = _read_points(run_dir / "trainer_metrics.jsonl")
    waiting = sum(s["pull_s"] for s in steps)
    publishing = sum(s["publish_s"] for s in steps)
    computing = sum(s["step_s"] - s["pull_s"] for s in steps)
    staleness = sum(s["staleness_mean"] for s in steps) / max(len(steps), 1)
    where = (f"relayrl trainer, of {seconds:.0f} s: {computing:.0f} s computing steps, {waiting:.0f} s waiting for "
             f"batches, {publishing:.0f} s publishing weights, the rest start-up and checkpoints")
    stale = (f"relayrl samples were {staleness:.2f} policy versions old on average (asynchronous, bounded by "
             f"max_staleness; ratio clipped against the sampling policy's logprobs); TRL's are on-policy")
    return where, stale


def _relayrl_startup_s(run_dir: Path) -> float:
    """Clock start (the trainer's config is written just before) to the driver's first generation."""
    first = _read_points(run_dir / "driver_stats.jsonl")[0]
    return first["time"] - first["elapsed_s"] - (run_dir / "trainer.yaml").stat().st_mtime


def _seconds(value: float | None) -> str:
    return "not reached" if value is None else f"{value:.0f} s"


def print_report(runs: list[Run], args: argparse.Namespace, start_accuracy: float) -> None:
    names = [run.name for run in runs]
    width = max(len(n) for n in names) + 2
    print(f"\nheld-out greedy exact match ({args.num_eval} prompts) over training wall-clock; "
          f"SFT start {start_accuracy:.3f}")
    print("time".rjust(8) + "".join(n.rjust(width) for n in names))
    step = max(args.eval_every_s, args.budget_s / 10)
    marks = [round(i * step) for i in range(int(args.budget_s // step) + 1)]
    for mark in marks[:-1]:
        print(f"{mark:>6} s" + "".join(f"{run.accuracy_near(mark):.3f}".rjust(width) for run in runs))
    print("   end  " + "".join(f"{run.final_accuracy:.3f}".rjust(width) for run in runs))

    print("\nthe same evaluations by optimizer step (learning per step)")
    print("step".rjust(8) + "".join(n.rjust(width) for n in names))
    last_common = min(run.steps for run in runs)
    for i in range(1, 6):
        mark = round(i * last_common / 5)
        print(f"{mark:>8}" + "".join(f"{run.accuracy_at_step(mark):.3f}".rjust(width) for run in runs))

    print()
    rows = [("time to 0.8", lambda r: _seconds(r.time_to(0.8))),
            ("time to 0.9", lambda r: _seconds(r.time_to(0.9))),
            (f"0.8 held ({SUSTAINED} evals)", lambda r: _seconds(r.time_held(0.8))),
            (f"0.9 held ({SUSTAINED} evals)", lambda r: _seconds(r.time_held(0.9))),
            ("final accuracy", lambda r: f"{r.final_accuracy:.3f}"),
            ("best accuracy", lambda r: f"{max(p['accuracy'] for p in r.curve):.3f}"),
            ("optimizer steps", lambda r: str(r.steps)),
            ("steps/min", lambda r: f"{60 * r.steps / r.seconds:.0f}"),
            ("completions", lambda r: str(r.completions)),
            ("training seconds", lambda r: f"{r.seconds:.0f}"),
            ("completions/s", lambda r: f"{r.completions_per_s:.1f}"),
            ("start-up s", lambda r: f"{r.startup_s:.1f}"),
            ("after start-up/s", lambda r: f"{r.steady_completions_per_s:.1f}")]
    print("".ljust(20) + "".join(n.rjust(width) for n in names))
    for label, cell in rows:
        print(label.ljust(20) + "".join(cell(run).rjust(width) for run in runs))
    print()
    for run in runs:
        for note in run.notes:
            print(note)


def print_results(relayrl: Run, trl: Run, budget_s: float) -> None:
    print()
    for threshold in THRESHOLDS:
        for name, time_of in ((f"time_to_{threshold}", Run.time_to), (f"time_to_{threshold}_held", Run.time_held)):
            ours, theirs = time_of(relayrl, threshold), time_of(trl, threshold)
            if ours is not None and theirs is not None:
                value = f"{ours / theirs:.2f}"
            else:
                value = f"n/a (relayrl {_seconds(ours)}, TRL {_seconds(theirs)} in {budget_s:.0f} s)"
            print(f"result: {name}_ratio = {value} (baseline {BASELINE}, target <= 1.0)")
    print(f"result: completions_per_s_ratio = {relayrl.completions_per_s / trl.completions_per_s:.2f} "
          f"(baseline {BASELINE}, target >= 1)")
    print(f"result: final_accuracy = {relayrl.final_accuracy:.3f} "
          f"(baseline {BASELINE} {trl.final_accuracy:.3f}, target >= baseline)")


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in runs:
        ax.plot([p["elapsed_s"] for p in run.curve], [p["accuracy"] for p in run.curve], marker=".", label=run.name)
    for threshold in THRESHOLDS:
        ax.axhline(threshold, color="grey", lw=0.5, ls="--")
    ax.set(xlabel="training wall-clock (s)", ylabel="held-out greedy exact match", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    args = parse_args()
    if args.only != "relayrl" and importlib.util.find_spec("trl") is None:
        sys.exit("bench/vs_trl.py: TRL is not installed; pip install -e '.[bench]'")
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    from _vs_trl.arith import TaskSpec
    from _vs_trl.warmstart import WarmStartSpec, build_start_checkpoint

    began = time.monotonic()
    print("load average at the start: {:.2f} {:.2f} {:.2f} (1, 5, 15 min; a quiet machine is the fair one)".format(
        *os.getloadavg()), flush=True)
    task = TaskSpec(num_eval=args.num_eval, split_seed=args.seed)
    warm = WarmStartSpec(task=task, seed=args.seed, target_accuracy=args.sft_target, max_new_tokens=args.max_new_tokens)
    start, warm_summary = build_start_checkpoint(warm, workdir)
    print(f"start checkpoint: {start} (SFT {warm_summary['steps']} steps, held-out {warm_summary['accuracy']:.3f})")

    runs: dict[str, Run] = {}
    if args.only in (None, "trl"):
        threads = trl_threads(args, start, workdir)
        print(f"TRL GRPOTrainer: {args.budget_s:.0f} s, {threads} torch threads (log {workdir / 'trl.log'})", flush=True)
        runs["trl"] = run_trl(args, start, workdir, threads)
    if args.only in (None, "relayrl"):
        print(f"relayrl: {args.budget_s:.0f} s (log {workdir / 'relayrl.log'})", flush=True)
        runs["relayrl"] = run_relayrl(args, start, workdir)

    print_report(list(runs.values()), args, warm_summary["accuracy"])
    plot(list(runs.values()), workdir / "vs_trl.png")
    (workdir / "vs_trl.json").write_text(json.dumps(
        {"args": vars(args), "start": warm_summary, **{k: r.__dict__ for k, r in runs.items()}}, indent=1))
    print(f"\ncurves: {workdir / 'vs_trl.json'}, plot: {workdir / 'vs_trl.png'} "
          f"(whole run {time.monotonic() - began:.0f} s)")
    if len(runs) == 2:
        print_results(runs["relayrl"], runs["trl"], args.budget_s)


if __name__ == "__main__":
    main()
