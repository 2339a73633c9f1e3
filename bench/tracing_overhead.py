"""What tracing costs: the quickstart's completions/s with tracing at its default sample rate and at 1.0, each over
tracing off (sample_rate 0), in alternating runs of the same invocation.

Each run is the quickstart's experiment file (deploy/experiment/quickstart_experiment.yaml, its project written
into a temporary folder) with the SFT warm-up shortened to --sft-steps and an RL budget of --budget-s; completions/s
is the run's summary (completions over RL seconds). The runs go off, default, 1.0, off, default, 1.0, ... so a drift of
the machine's load falls on every setting alike; each ratio is the setting's mean over off's mean. It also counts
the complete traces a default-rate run left (traced groups whose spans reach the trainer's step), and how closely
the trainer's stage reports sum to the wall-clock interval their reports span.

    python bench/tracing_overhead.py [--rounds 2] [--budget-s 60] [--sft-steps 50]
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_once(experiment: pathlib.Path, run_dir: pathlib.Path, rate: float | None, budget_s: float,
             sft_steps: int) -> float:
    """One quickstart run's completions/s; `rate` None: the default sample rate."""
    overrides = [f"run_dir={run_dir}", f"training.time_budget_s={budget_s}", f"sft.steps={sft_steps}",
                 "evaluation.every_s=1000"]
    if rate is not None:
        overrides.append(f"tracing.sample_rate={rate}")
    command = [sys.executable, "-m", "deploy.cli", "run", str(experiment)]
    for item in overrides:
        command += ["--set", item]
    done = subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=budget_s * 3 + 600)
    if done.returncode != 0:
        raise RuntimeError(f"run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary["completions"] / summary["rl_seconds"]


def complete_traces(run_dir: pathlib.Path) -> int:
    """Traced groups whose trace holds the rollout's, the reward's and the buffer's spans and a trainer step."""
    from deploy.inspect.chrome_trace import read_spans

    services: dict[str, set[str]] = {}
    for span in read_spans(run_dir):
        services.setdefault(span["trace_id"], set()).add(span["service"])
    return sum({"driver", "rollout", "reward", "buffer", "trainer"} <= seen for seen in services.values())


def stage_sum_over_interval(run_dir: pathlib.Path) -> float:
    """The trainer's stage reports summed over its steps but the first, over the wall-clock time their reports span
    (trainer/stages.py: step N's interval runs from step N-1's report to its own)."""
    steps = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines() if line]
    if len(steps) < 2:
        return float("nan")
    return sum(step["stage/step_s"] for step in steps[1:]) / (steps[-1]["stage/report_time"]
                                                              - steps[0]["stage/report_time"])


def service_stage_sums(run_dir: pathlib.Path) -> list[float]:
    """Each rollout and reward process's stage reports (RUN_DIR/stages, services/stage_reports.py) after its first,
    over the wall-clock time between its first and last report."""
    sums = []
    for path in sorted((run_dir / "stages").glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line]
        if len(lines) >= 2:
            span = lines[-1]["stage/report_time"] - lines[0]["stage/report_time"]
            sums.append(sum(line["stage/interval_s"] for line in lines[1:]) / span)
    return sums


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--sft-steps", type=int, default=50)
    args = parser.parse_args()
    from deploy.experiment.quickstart import write_project
    from services.config import TracingConfig

    default = TracingConfig().sample_rate
    settings = {"off": 0.0, "default": None, "full": 1.0}
    rates: dict[str, list[float]] = {name: [] for name in settings}
    with tempfile.TemporaryDirectory(prefix="relayrl-tracing-") as tmp:
        experiment = write_project(pathlib.Path(tmp) / "project")
        traces, sums, service_sums = 0, [], []
        for round_index in range(args.rounds):
            for name, rate in settings.items():
                run_dir = pathlib.Path(tmp) / f"run-{name}-{round_index}"
                rates[name].append(run_once(experiment, run_dir, rate, args.budget_s, args.sft_steps))
                sums.append(stage_sum_over_interval(run_dir))
                service_sums += service_stage_sums(run_dir)
                print(f"round {round_index} {name}: {rates[name][-1]:.1f} completions/s", flush=True)
                if name == "default":
                    traces = min(traces, complete_traces(run_dir)) if round_index else complete_traces(run_dir)
    off = statistics.fmean(rates["off"])
    for name, label in (("default", f"default_{default:g}"), ("full", "full_1.0")):
        mean = statistics.fmean(rates[name])
        print(f"result: tracing_overhead_{label} = {mean / off:.3f} ({mean:.1f} completions/s with tracing at "
              f"sample_rate {default if name == 'default' else 1.0:g} over {off:.1f} off; {args.rounds} alternating "
              f"rounds of {args.budget_s:.0f} s)")
    print(f"result: stage_sum_over_interval = {min(sums):.4f}..{max(sums):.4f} (the trainer's stage reports over "
          f"the wall-clock time between its first and last report, {len(sums)} runs)")
    if service_sums:
        print(f"result: service_stage_sum_over_interval = {min(service_sums):.4f}..{max(service_sums):.4f} (the "
              f"rollout's and reward's stage reports over the time between each process's first and last report, "
              f"{len(service_sums)} processes)")
    print(f"result: tracing_complete_traces_default = {traces} (the fewest complete traces a default-rate run left)")


if __name__ == "__main__":
    main()
