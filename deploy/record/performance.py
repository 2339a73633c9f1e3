"""A run's performance summary in NeMo-RL's form, from its stage reports: per service and stage, the share of time
and tokens/s per device; the trainer's step time and MFU and the engines'; the refit per receiver; peak memory.

Read from what the processes write (docs/observability.md): the trainer's steps (`stage/*`, `perf/*`, `refit/*` in
trainer_metrics.jsonl; its first step left out when there are more, a warm-up), the rollout's and the reward's intervals
(RUN_DIR/stages/<service>-<pid>.jsonl, services/stage_reports.py). Every process is one device (a rollout replica,
a reward process) or, for the trainer, `perf/devices` ranks. `window_s` keeps the reports of the last so many
seconds (what `relayrl status` shows); None: the whole run (the summary at its end).
"""

import json
import pathlib
import time
from collections import defaultdict

from rich.table import Table

TRAINER_STAGES = ("data_wait", "forward", "backward", "optimizer", "publish", "pause", "checkpoint")
ROLLOUT_STAGES = ("prefill", "decode", "weight_switch", "commands", "idle")
REWARD_STAGES = ("scoring", "idle")


def _lines(path: pathlib.Path) -> list[dict]:
    records = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue  # a line still being written
    return records


def _recent(records: list[dict], window_s: float | None) -> list[dict]:
    """The reports of the last `window_s` seconds by the wall clock (a process gone longer has none)."""
    if window_s is None:
        return records
    since = time.time() - window_s
    return [r for r in records if r.get("stage/report_time", 0.0) >= since]


def _shares(records: list[dict], stages: tuple[str, ...], interval: str) -> tuple[float, dict[str, dict]]:
    total = sum(r.get(interval, 0.0) for r in records)
    return total, {stage: {"seconds": (seconds := sum(r.get(f"stage/{stage}_s", 0.0) for r in records)),
                           "share": seconds / total if total > 0 else 0.0} for stage in stages}


def trainer_performance(run_dir: pathlib.Path, window_s: float | None = None) -> dict | None:
    steps = [r for r in _lines(run_dir / "trainer_metrics.jsonl") if "stage/step_s" in r]
    steps = _recent(steps[1:] if len(steps) > 1 else steps, window_s)  # the first step warms up
    if not steps:
        return None
    total, stages = _shares(steps, TRAINER_STAGES, "stage/step_s")
    devices = steps[-1].get("perf/devices", 1)
    tokens = sum(r.get("perf/tokens", 0) for r in steps)
    peak = steps[-1].get("perf/peak_flops") or 0.0
    memory = {"rank0": max(r.get("perf/peak_memory_gb", 0.0) for r in steps)}
    for key in steps[-1]:
        if key.startswith("perf/peak_memory_gb/"):
            memory[key.rsplit("/", 1)[1]] = max(r.get(key, 0.0) for r in steps)
    refit: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    last: dict[str, float] = {}  # a publish's timings repeat on every step until the next publish's
    for r in steps:
        for key, value in r.items():
            if key.startswith("refit/") and last.get(key) != value:
                receiver, what = key[len("refit/"):].rsplit("/", 1)
                refit[receiver][what].append(value)
                last[key] = value
    return {
        "steps": len(steps), "seconds": total, "step_s_mean": total / len(steps), "devices": devices,
        "stages": stages, "tokens": tokens,
        "tokens_per_s_per_device": tokens / total / devices if total > 0 else 0.0,
        "mfu": sum(r.get("perf/flops", 0.0) for r in steps) / total / peak if total > 0 and peak else None,
        "peak_memory_gb": memory,
        "refit": {receiver: {what: sum(values) / len(values) for what, values in timings.items()}
                  for receiver, timings in refit.items()},
    }


def service_performance(run_dir: pathlib.Path, service: str, window_s: float | None = None) -> dict | None:
    """The rollout's or the reward's intervals, every process of it together (each process: one device)."""
    per_process = {path.stem: _recent(_lines(path), window_s)
                   for path in sorted((run_dir / "stages").glob(f"{service}-*.jsonl"))}
    records = [r for lines in per_process.values() for r in lines]
    if not records:
        return None
    stages = ROLLOUT_STAGES if service == "rollout" else REWARD_STAGES
    total, shares = _shares(records, stages, "stage/interval_s")

    def summed(key: str) -> float:
        return sum(r.get(key, 0.0) for r in records)

    out = {"processes": len(per_process), "seconds": total, "stages": shares}
    if service == "rollout":
        prefill, decode = summed("engine/prefill_tokens"), summed("engine/decode_tokens")
        peaks = [r["perf/peak_flops"] for r in records if r.get("perf/peak_flops")]
        waits = [(r["engine/queue_wait_mean_s"], r["engine/scheduled"]) for r in records if r.get("engine/scheduled")]
        steps = summed("engine/steps")
        out.update({
            "prefill_tokens": prefill, "decode_tokens": decode,
            "tokens_per_s_per_device": (prefill + decode) / total if total > 0 else 0.0,
            "prefill_tokens_per_s": prefill / shares["prefill"]["seconds"] if shares["prefill"]["seconds"] else 0.0,
            "decode_tokens_per_s": decode / shares["decode"]["seconds"] if shares["decode"]["seconds"] else 0.0,
            "mfu": summed("perf/flops") / total / (sum(peaks) / len(peaks)) if peaks and total > 0 else None,
            "queue_wait_mean_s": sum(w * n for w, n in waits) / sum(n for _, n in waits) if waits else 0.0,
            "queue_wait_max_s": max((r.get("engine/queue_wait_max_s", 0.0) for r in records), default=0.0),
            "kv_used_mean": sum(r.get("engine/kv_used_mean", 0.0) * r.get("engine/steps", 0) for r in records) / steps
            if steps else 0.0,
            "kv_used_peak": max((r.get("engine/kv_used_peak", 0.0) for r in records), default=0.0),
            "peak_memory_gb": {name: max((r.get("engine/peak_memory_gb", 0.0) for r in lines), default=0.0)
                               for name, lines in per_process.items()},
        })
    else:
        out.update({"samples": summed("reward/samples"), "calls": summed("reward/calls"),
                    "samples_per_s_per_process": summed("reward/samples") / total if total > 0 else 0.0})
    return out


def performance(run_dir: pathlib.Path, window_s: float | None = None) -> dict:
    """{trainer, rollout, reward}: each None when the run has no reports of it."""
    return {"trainer": trainer_performance(run_dir, window_s),
            "rollout": service_performance(run_dir, "rollout", window_s),
            "reward": service_performance(run_dir, "reward", window_s)}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def performance_table(perf: dict, title: str = "where the time goes") -> Table | None:
    """The summary as one table, a row per service and stage, its details in the caption (None: no stage reports)."""
    if not any(perf.values()):
        return None
    table = Table(title=title, header_style="bold", caption_justify="left")
    for column in ("service", "stage", "share of time", "seconds", "tokens/s per device", "MFU"):
        table.add_column(column, justify="left" if column in ("service", "stage") else "right")
    notes = []
    trainer, rollout, reward = perf["trainer"], perf["rollout"], perf["reward"]
    if trainer is not None:
        for stage, value in trainer["stages"].items():
            table.add_row("trainer", stage, _pct(value["share"]), f"{value['seconds']:.3g}", "", "")
        table.add_row("trainer", "[bold]step[/]", "100%", f"{trainer['seconds']:.3g}",
                      f"{trainer['tokens_per_s_per_device']:.0f}", _pct(trainer["mfu"]))
        memory = ", ".join(f"{rank} {gb:.2f}" for rank, gb in trainer["peak_memory_gb"].items())
        notes.append(f"trainer: {trainer['steps']} steps, {trainer['step_s_mean']:.3f} s each on "
                     f"{trainer['devices']} device(s); peak memory GB {memory}")
        for receiver, timings in trainer["refit"].items():
            notes.append(f"refit {receiver} (mean per publish): " + ", ".join(
                f"{what.removesuffix('_s')} {value:.3f} s" for what, value in sorted(timings.items())))
    if rollout is not None:
        rates = {"prefill": rollout["prefill_tokens_per_s"], "decode": rollout["decode_tokens_per_s"]}
        for stage, value in rollout["stages"].items():
            table.add_row("rollout", stage, _pct(value["share"]), f"{value['seconds']:.3g}",
                          f"{rates[stage]:.0f}" if stage in rates else "", "")
        table.add_row("rollout", "[bold]all[/]", "100%", f"{rollout['seconds']:.3g}",
                      f"{rollout['tokens_per_s_per_device']:.0f}", _pct(rollout["mfu"]))
        memory = ", ".join(f"{gb:.2f}" for gb in rollout["peak_memory_gb"].values())
        notes.append(f"rollout: {rollout['processes']} engine(s), prefill and decode tokens/s while in the stage; "
                     f"queue wait mean {rollout['queue_wait_mean_s']:.3f} s, max {rollout['queue_wait_max_s']:.3f} s; "
                     f"KV used mean {_pct(rollout['kv_used_mean'])}, peak {_pct(rollout['kv_used_peak'])}; "
                     f"peak memory GB {memory}")
    if reward is not None:
        for stage, value in reward["stages"].items():
            table.add_row("reward", stage, _pct(value["share"]), f"{value['seconds']:.3g}", "", "")
        table.add_row("reward", "[bold]all[/]", "100%", f"{reward['seconds']:.3g}", "", "")
        notes.append(f"reward: {reward['processes']} process(es), {reward['samples']:.0f} samples, "
                     f"{reward['samples_per_s_per_process']:.1f}/s per process")
    table.caption = "\n".join(notes)
    return table
