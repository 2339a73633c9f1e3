"""The doctor's bound-by verdict: which stage holds a run back, read from the trainer's per-stage step reports
(`stage/*` in trainer_metrics.jsonl, trainer/stages.py) and, for the generation side, the run's spans
(RUN_DIR/traces, services/tracing.py): its evidence, and the lever that moves it.

    generation-bound   the trainer waited for batches most of its time; the spans say whether generating or
                       scoring took the longer (the rollout's GenerateMany or the reward's Score calls)
    trainer-bound      forward, backward and optimizer fill most of the step (with the MFU they reached) while
                       generation idled most of its time (the driver's idle_s: admission refused by the staleness
                       bound and nothing in flight) on engines with devices of their own; a trainer busy computing
                       while generation keeps working is the steady state a run aims at, no verdict, and so is one
                       whose engines idle on the CPU cores the trainer computes on (their stage reports'
                       engine/accelerator 0, as in the local quickstart): that idle time is the trainer's
    weight-sync-bound  publishing weights (and the engines' pause a blocking publish waits out)
    checkpoint-bound   checkpoints
    stragglers         one rank's compute well above another's in the same steps

A run whose stages share its time (none over BOUND of it) gets no verdict.
"""

import json
import statistics
from collections import defaultdict

from deploy.inspect.chrome_trace import read_spans
from deploy.inspect.findings import Finding
from deploy.record.run_record import Row

BOUND = 0.5  # a stage group over this share of the trainer's time is what the run is bound by
STRAGGLER = 1.3  # a rank's compute this many times the fastest rank's
GROUPS = {
    "data wait": ("data_wait",),
    "compute": ("forward", "backward", "optimizer"),
    "weight sync": ("publish", "pause"),
    "checkpoint": ("checkpoint",),
}
GENERATE, SCORE = "relayrl.rollout.v1.Rollout/GenerateMany", "relayrl.reward.v1.Reward/Score"


def staged(rows: list[Row]) -> list[Row]:
    """The rows with a stage report (runs from before it have none)."""
    return [row for row in rows if isinstance(row.record.get("stage/step_s"), int | float)]


def shares(rows: list[Row]) -> tuple[dict[str, float], float]:
    """Each stage group's share of the summed step intervals, and that sum."""
    total = sum(row.record["stage/step_s"] for row in rows)
    seconds = {group: sum(row.record.get(f"stage/{stage}_s", 0.0) for row in rows for stage in stages)
               for group, stages in GROUPS.items()}
    return {group: value / total if total else 0.0 for group, value in seconds.items()}, total


def generation_split(run_dir) -> dict[str, float]:
    """Seconds the traced groups spent in the rollout's generate calls and the reward's score calls."""
    seconds: dict[str, float] = defaultdict(float)
    for span in read_spans(run_dir):
        if span["name"] in (GENERATE, SCORE):
            seconds[span["name"]] += (span["end_ns"] - span["start_ns"]) / 1e9
    return seconds


def generation_held(rows: list[Row]) -> tuple[float, Row, Row] | None:
    """The share of the driver's time generation idled, waiting on the trainer (driver_stats.jsonl's idle_s over
    elapsed_s, first line to last), with those lines; None when the driver does not record it."""
    counted = [row for row in rows if isinstance(row.record.get("idle_s"), int | float)
               and isinstance(row.record.get("elapsed_s"), int | float)]
    if len(counted) < 2:
        return None
    first, last = counted[0], counted[-1]
    elapsed = last.record["elapsed_s"] - first.record["elapsed_s"]
    held = last.record["idle_s"] - first.record["idle_s"]
    return (held / elapsed if elapsed > 0 else 0.0), first, last


def engines_on_the_cpu(run_dir) -> bool:
    """Whether the run's engines report that they run on the CPU (every rollout stage report's engine/accelerator
    is 0); False when none reports it (runs from before the reports, or their engines elsewhere)."""
    seen = []
    for path in sorted((run_dir / "stages").glob("rollout*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                seen.append(json.loads(line).get("engine/accelerator"))
            except ValueError:
                continue  # a line still being written
    seen = [value for value in seen if value is not None]
    return bool(seen) and not any(seen)


def check_bottleneck(run, rows: list[Row], findings: list[Finding]) -> None:
    """The bound-by verdict over `rows` (trainer_metrics.jsonl rows with stage reports, the first step left out)."""
    share, total = shares(rows)
    where = f"trainer_metrics.jsonl:{rows[0].number}-{rows[-1].number}"
    spread = ", ".join(f"{group} {value:.0%}" for group, value in share.items())
    evidence = [f"{where}: stage/* over {len(rows)} steps ({total:.1f}s): {spread}"]
    group = max(share, key=share.get)
    _stragglers(rows, where, findings)
    held = generation_held(run.driver)
    shared = engines_on_the_cpu(run.dir)
    if group == "compute" and share[group] > BOUND and (held is None or held[0] <= BOUND or shared):
        mfu = statistics.fmean(row.record.get("perf/mfu", 0.0) for row in rows)
        keeps_up = ("generation keeps up" if held is None else
                    f"generation keeps working (idle {held[0]:.0%} of its time, waiting on the trainer)")
        if held is not None and held[0] > BOUND:
            keeps_up = (f"generation idles {held[0]:.0%} of its time waiting on it, on the CPU cores the trainer "
                        "computes on (stages/rollout*: engine/accelerator 0), so that time is the trainer's")
        findings.append(Finding("ok", "bottleneck", f"the trainer computes {share[group]:.0%} of its time (MFU "
                                f"{mfu:.1%}) and {keeps_up}: no stage holds the run back", evidence=evidence))
        return
    if share[group] <= BOUND:
        findings.append(Finding("ok", "bottleneck", f"no stage holds the run back: {spread} of the trainer's "
                                f"{total:.1f}s over {len(rows)} steps", evidence=evidence))
        return
    waited = sum(row.record.get("stage/data_wait_s", 0.0) > 0.5 * row.record["stage/step_s"] for row in rows)
    if group == "data wait":
        message = (f"the trainer waited on the buffer for {share[group]:.0%} of its time ({waited} of {len(rows)} "
                   "steps waited over half their interval): generation-bound")
        split = generation_split(run.dir)
        generate, score = split.get(GENERATE, 0.0), split.get(SCORE, 0.0)
        if score > generate:
            message += f"; scoring is the slow part (the reward's Score calls {score:.1f}s against {generate:.1f}s " \
                       "of generation in the traced groups)"
            fix = ("faster scoring: reward replicas (services.reward.replicas), more workers (services.reward."
                   "settings.max_concurrency), a cheaper reward function; or let generation run further ahead "
                   "(training.max_staleness)")
        else:
            if generate:
                message += f"; generating is the slow part ({generate:.1f}s against {score:.1f}s of scoring)"
            fix = ("more generation: add rollout replicas (`relayrl deploy scale rollout N --run RUN_DIR`, or "
                   "services.rollout.replicas), more prompts in flight (training.concurrency), shorter completions "
                   "(training.max_tokens), or raise training.max_staleness")
        if split:
            evidence.append(f"traces/: GenerateMany {generate:.1f}s, Score {score:.1f}s over the traced groups")
    elif group == "compute":
        mfu = statistics.fmean(row.record.get("perf/mfu", 0.0) for row in rows)
        message = (f"forward, backward and optimizer take {share[group]:.0%} of the trainer's time (MFU "
                   f"{mfu:.1%}) and generation idled {held[0]:.0%} of its time, waiting on it: "
                   "trainer-bound; generation waits on the trainer")
        evidence.append(f"{held[2].file}:{held[1].number}-{held[2].number}: idle_s / elapsed_s")
        fix = ("a faster trainer: more trainer ranks (services.trainer.world_size), bfloat16 (dtype), sequence "
               "packing (batch.packing), fewer tokens per step (training.batch_size, training.max_tokens); or "
               "fewer rollout replicas, which idle")
    elif group == "weight sync":
        message = f"publishing weights takes {share[group]:.0%} of the trainer's time: weight-sync-bound"
        fix = ("overlap the publish with the next step (training.publish_overlap / publish.overlap), publish less "
               "often (publish.interval), or a faster transfer (publish.backend)")
    else:
        message = f"checkpoints take {share[group]:.0%} of the trainer's time: checkpoint-bound"
        fix = "checkpoint less often (checkpoint.interval)"
    findings.append(Finding("warn", "bottleneck", message, fix, evidence))


def _stragglers(rows: list[Row], where: str, findings: list[Finding]) -> None:
    compute: dict[str, float] = defaultdict(float)
    for row in rows:
        for key, value in row.record.items():
            stage, _, rank = key.removeprefix("stage/").partition("_s")
            if key.startswith("stage/") and stage in GROUPS["compute"] and (rank or "/rank0").startswith("/rank"):
                compute[rank.removeprefix("/") or "rank0"] += value
    if len(compute) < 2:
        return
    slow, fast = max(compute, key=compute.get), min(compute, key=compute.get)
    if compute[fast] > 0 and compute[slow] / compute[fast] >= STRAGGLER:
        findings.append(Finding("warn", "stragglers", f"{slow} computed {compute[slow]:.1f}s against {fast}'s "
                                f"{compute[fast]:.1f}s over the same steps: every step waits for it",
                                "even out the ranks' work (batch.max_tokens_per_micro_batch balances tokens), or look "
                                "for a slower device or a busier node", [f"{where}: stage/*_s/rank*"]))
