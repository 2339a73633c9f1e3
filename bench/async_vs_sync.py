"""Does asynchrony pay on an agentic task? max_staleness 0 (synchronous) against 1, 2 and 4.

The tool-use environment (examples/agentic/tool_use.yaml: the model calls a calculator whose answer takes
50-200 ms, like a real tool, then answers) trains with the same model, SFT checkpoint, seed and RL time
budget at each max_staleness. For each run it reports optimizer steps per hour, the trainer's data-wait
fraction (time waiting for a batch / step time, from trainer_metrics.jsonl: `pull_s` / `step_s`), the time
to reach a fixed held-out success rate, and the final success rate; each against staleness 0 measured in
the same invocation. Off-policy correction (bypass: the PPO ratio against the rollout's logprobs, clipped) is
on whenever max_staleness > 0, and the runner keeps (max_staleness + 1) batches of groups in flight, so
admission control alone bounds them (deploy/runs/agentic.py: an experiment file with `env`).

The SFT checkpoint is built once (by the first run) and every later run starts from it.

It also samples the machine's CPU (/proc/stat, every second) and reports the cores busy on average over each RL
phase (the runner's first to last stats line). On a machine whose generation and training share the same cores,
overlapping them cannot make a step cheaper than (CPU seconds of one step) / (cores): a synchronous run keeping B
of N cores busy bounds every asynchronous one at N / B its steps per hour (`ceiling` below), whatever the
staleness. Run it on a quiet machine: other jobs count as busy.

    python bench/async_vs_sync.py [--budget-s 300] [--staleness 0 1 2 4] [--seed 0] [--quick]
"""

import argparse
import json
import os
import pathlib
import shutil
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "examples" / "agentic" / "tool_use.yaml"


def trainer_wait_fraction(run_dir: pathlib.Path) -> float:
    """Seconds the trainer waited for batches over its seconds per step, summed over the run."""
    records = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines() if line]
    waited = sum(r.get("pull_s", 0.0) for r in records)
    total = sum(r.get("step_s", 0.0) for r in records)
    return waited / total if total else float("nan")


class CpuSampler:
    """(wall time, busy jiffies, all jiffies) of the whole machine every second, from /proc/stat."""

    def __init__(self):
        self.samples: list[tuple[float, int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            fields = [int(x) for x in pathlib.Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            idle = fields[3] + fields[4]  # idle + iowait
            self.samples.append((time.time(), sum(fields) - idle, sum(fields)))
            self._stop.wait(1.0)

    def busy_cores(self, start: float, end: float) -> float:
        """Cores busy on average between two wall times (the machine's, all processes)."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return float("nan")
        (_, busy0, all0), (_, busy1, all1) = inside[0], inside[-1]
        return (busy1 - busy0) / (all1 - all0) * (os.cpu_count() or 1)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def rl_window(run_dir: pathlib.Path) -> tuple[float, float]:
    """Wall times of the runner's first and last stats lines: the RL phase."""
    times = [json.loads(line)["time"] for line in (run_dir / "runner_stats.jsonl").read_text().splitlines() if line]
    return times[0], times[-1]


def time_to(curve: list[dict], target: float) -> float | None:
    for point in curve:
        if point["success_rate"] >= target:
            return point["elapsed_s"]
    return None


def run(staleness: int, args, start_checkpoint: str | None, out: pathlib.Path):
    """One run of the experiment file at `staleness` (deploy.record.run_state.Summary: its accuracy fields hold the held-out
    success rate), from `start_checkpoint` (a Hugging Face folder: no SFT) when given."""
    from deploy.experiment.schema import load_experiment
    from deploy.runs.agentic import run_agentic

    threads = args.sync_trainer_threads if staleness == 0 else args.async_trainer_threads
    overrides = [f"seed={args.seed}", f"run_dir={out / f'staleness-{staleness}'}",
                 f"training.max_staleness={staleness}", f"training.time_budget_s={args.budget_s}",
                 f"evaluation.every_s={args.eval_interval_s}", f'services.trainer.settings={{"num_threads": {threads}}}',
                 f'services.rollout.settings={{"engine.torch_threads": {args.rollout_threads}}}']
    if args.quick:
        overrides += ["sft.steps=20", "sft.transcripts=200"]
    if start_checkpoint:  # after --quick's SFT settings: no SFT at all
        overrides += ["model.tiny=null", f"model.path={start_checkpoint}", "sft.steps=0"]
    return run_agentic(load_experiment(CONFIG, overrides))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-s", type=float, default=300.0, help="RL seconds per run")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-interval-s", type=float, default=30.0)
    parser.add_argument("--target", type=float, default=None,
                        help="success rate for time-to-target; default: half-way from the start to staleness 0's final")
    # Each side at its best on 2 cores (60 s runs, steps/h): synchronous, the trainer runs alone, so 2 threads
    # (4,126-4,230 vs 3,579 at 1); asynchronous, it shares the cores with generation, so 1 (6,455 vs 4,499 at 2).
    parser.add_argument("--sync-trainer-threads", type=int, default=2, help="torch threads of the staleness-0 trainer")
    parser.add_argument("--async-trainer-threads", type=int, default=1, help="torch threads of the other trainers")
    parser.add_argument("--rollout-threads", type=int, default=2, help="torch threads of the rollout engine")
    parser.add_argument("--out", default="runs/async_vs_sync")
    parser.add_argument("--quick", action="store_true", help="tiny SFT, 45 s per run, staleness 0 and 1")
    args = parser.parse_args()
    if args.quick:
        args.budget_s, args.staleness, args.eval_interval_s = 45.0, [0, 1], 20.0
    if 0 not in args.staleness:
        parser.error("--staleness must include 0: it is the baseline")
    out = (ROOT / args.out).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)

    order = [0] + [s for s in args.staleness if s != 0]
    results, checkpoint = {}, None
    cpu = CpuSampler()
    for staleness in order:
        summary = run(staleness, args, checkpoint, out)
        run_dir = pathlib.Path(summary.run_dir)
        if checkpoint is None:  # every run starts from the first run's SFT checkpoint
            checkpoint = str(out / "model-sft")
            shutil.copytree(run_dir / "model-sft", checkpoint)
        results[staleness] = {"summary": summary, "wait": trainer_wait_fraction(run_dir),
                              "steps_per_hour": summary.steps / summary.rl_seconds * 3600,
                              "busy": cpu.busy_cores(*rl_window(run_dir))}
    cpu.close()
    base = results[0]
    target = args.target
    if target is None:
        start = base["summary"].sft_accuracy
        target = start + 0.5 * (base["summary"].final_accuracy - start)
    print(f"\ntool-use, seed {args.seed}, {args.budget_s:g} s of RL per run, time-to-target at success >= {target:.3f}; "
          f"trainer threads: sync {args.sync_trainer_threads}, async {args.async_trainer_threads}; rollout threads "
          f"{args.rollout_threads}")
    print(f"{'staleness':>9} {'steps':>6} {'steps/h':>8} {'x sync':>7} {'data wait':>10} {'t->target':>10} "
          f"{'start':>6} {'final':>6} {'best':>6} {'cores busy':>11}")
    for staleness in order:
        r = results[staleness]
        s = r["summary"]
        reach = time_to(s.curve, target)
        print(f"{staleness:>9} {s.steps:>6} {r['steps_per_hour']:>8.0f} {r['steps_per_hour'] / base['steps_per_hour']:>7.2f} "
              f"{r['wait']:>10.1%} {('-' if reach is None else f'{reach:.0f} s'):>10} {s.sft_accuracy:>6.3f} "
              f"{s.final_accuracy:>6.3f} {s.best_accuracy:>6.3f} {r['busy']:>6.2f} of {os.cpu_count()}")
    ceiling = (os.cpu_count() or 1) / base["busy"]
    print(f"result: async_ceiling_vs_sync = {ceiling:.2f} (baseline max_staleness 0 kept {base['busy']:.2f} of "
          f"{os.cpu_count()} cores busy: no overlap of work on these cores can exceed this ratio)")
    for staleness in order[1:]:
        r = results[staleness]
        print(f"result: steps_per_hour_staleness_{staleness}_vs_sync = "
              f"{r['steps_per_hour'] / base['steps_per_hour']:.2f} (baseline max_staleness 0, target >= 2)")
        print(f"result: data_wait_staleness_{staleness} = {r['wait']:.3f} (baseline max_staleness 0 "
              f"{base['wait']:.3f}, target < 0.10)")
        print(f"result: final_success_staleness_{staleness}_minus_sync = "
              f"{r['summary'].final_accuracy - base['summary'].final_accuracy:+.3f} (baseline max_staleness 0 "
              f"{base['summary'].final_accuracy:.3f}, target within noise)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
