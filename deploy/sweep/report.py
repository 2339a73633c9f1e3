"""What a sweep leaves to read (deploy/sweep/study.py): a results table (SWEEP_DIR/results.csv and printed), the best trial,
and Optuna's plots in SWEEP_DIR/plots/ as HTML (plotly) and PNG (optuna.visualization.matplotlib: plotly's own PNG
export needs kaleido and a Chrome it downloads).

    optimization_history   each finished trial's value and the best so far
    intermediate_values    each trial's held-out curve during RL (what the pruner compared), pruned ones cut short
    param_importances      with 2 parameters or more and MIN_IMPORTANCE_TRIALS completed trials

A trial's figures are read from its run folder (summary.json; metrics.jsonl for a pruned or failed one), its state,
value and parameters from the study.
"""

import csv
import json
import pathlib
import warnings

from rich.console import Console
from rich.table import Table

from deploy.record.run_state import SUMMARY_FILE

MIN_IMPORTANCE_TRIALS = 3
PLOTS_DIR = "plots"
FIELDS = ("trial", "state", "value", "start", "final", "best", "evaluations", "steps", "rl_seconds", "note")


def trial_dir(sweep_dir: pathlib.Path, number: int) -> pathlib.Path:
    return sweep_dir / f"trial-{number}"


def results(study, sweep_dir: pathlib.Path) -> list[dict]:
    """One row per trial: number, state, value, its parameters by field path, what its run reached, its folder."""
    rows = []
    for trial in study.get_trials(deepcopy=False):
        run_dir = trial_dir(sweep_dir, trial.number)
        summary = _read_json(run_dir / SUMMARY_FILE)
        curve = summary.get("curve") or _read_jsonl(run_dir / "metrics.jsonl")
        note = trial.user_attrs.get("failed") or (f"re-run of trial-{trial.user_attrs['rerun_of']}"
                                                  if "rerun_of" in trial.user_attrs else "")
        if trial.state.name == "FAIL" and "failed" not in trial.user_attrs:
            note = "interrupted (run again as a new trial)"
        rows.append({
            "trial": trial.number, "state": trial.state.name.lower(), "value": trial.value,
            **{name: trial.params.get(name) for name in sorted(trial.distributions)},
            "start": curve[0]["accuracy"] if curve else None,
            "final": summary.get("final_accuracy", curve[-1]["accuracy"] if curve else None),
            "best": summary.get("best_accuracy", max((p["accuracy"] for p in curve), default=None)), "evaluations": len(curve),
            "steps": summary.get("steps", curve[-1].get("step") if curve else None),
            "rl_seconds": summary.get("rl_seconds", curve[-1]["elapsed_s"] if curve else None),
            "note": note, "run_dir": str(run_dir),
        })
    return rows


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    columns = list(dict.fromkeys(key for row in rows for key in row)) or [*FIELDS, "run_dir"]
    staging = path.with_suffix(".csv.tmp")
    with open(staging, "w", newline="") as file:
        writer = csv.DictWriter(file, columns)
        writer.writeheader()
        writer.writerows(rows)
    staging.replace(path)


def table(rows: list[dict], params: list[str], best: int | None, objective: str) -> Table:
    """The results as a rich table, the best trial in bold."""
    out = Table(title=f"relayrl sweep: {len(rows)} trials (value = {objective} held-out mean reward)",
                header_style="bold")
    for name in ("trial", "state", "value", *params, "start", "final", "best", "evals", "steps", "RL s", "note"):
        out.add_column(name, justify="left" if name in ("state", "note") else "right")
    for row in rows:
        cells = [f"trial-{row['trial']}", row["state"], _num(row["value"]),
                 *(_num(row.get(name)) for name in params), _num(row["start"]), _num(row["final"]),
                 _num(row["best"]), str(row["evaluations"]), _num(row["steps"]), _num(row["rl_seconds"], ".0f"),
                 row["note"]]
        out.add_row(*cells, style="bold" if row["trial"] == best else None)
    return out


def best_trial(study):
    """The best completed trial, or None."""
    if not any(t.state.name == "COMPLETE" for t in study.get_trials(deepcopy=False)):
        return None
    return study.best_trial


def report(study, sweep_dir: pathlib.Path, objective: str, console: Console) -> dict | None:
    """Write results.csv and the plots, print the table and the best trial; the best trial's row (None: no trial
    completed)."""
    rows = results(study, sweep_dir)
    write_csv(rows, sweep_dir / "results.csv")
    params = sorted(study.get_trials(deepcopy=False)[0].distributions) if rows else []
    best = best_trial(study)
    console.print(table(rows, params, best.number if best else None, objective))
    console.print(f"results: {sweep_dir / 'results.csv'}")
    written = plots(study, sweep_dir / PLOTS_DIR, len(params), objective)
    if written:
        console.print(f"plots: {', '.join(str(p) for p in written)}")
    if best is None:
        console.print("[red]no trial completed[/]: nothing to name as best")
        return None
    row = next(r for r in rows if r["trial"] == best.number)
    shown = ", ".join(f"{name}={_num(value)}" for name, value in best.params.items())
    console.print(f"[bold]best trial: trial-{best.number}[/] value {best.value:.4f} ({objective} held-out mean reward; "
                  f"start of RL {_num(row['start'])}) with {shown}\n  run folder: {row['run_dir']}")
    return row


def plots(study, folder: pathlib.Path, num_params: int, objective: str = "final") -> list[pathlib.Path]:
    """Optuna's plots of the study as HTML and PNG, their axes named as a sweep reads them; the files written (none
    before a trial finished)."""
    finished = [t for t in study.get_trials(deepcopy=False) if t.state.name in ("COMPLETE", "PRUNED")]
    if not finished:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna.visualization as plotly_plots
    import optuna.visualization.matplotlib as mpl_plots
    from optuna.exceptions import ExperimentalWarning

    folder.mkdir(parents=True, exist_ok=True)
    names = ["optimization_history", "intermediate_values"]
    completed = sum(t.state.name == "COMPLETE" for t in finished)
    if num_params >= 2 and completed >= MIN_IMPORTANCE_TRIALS:
        names.append("param_importances")
    labels = {"optimization_history": ("trial", f"{objective} held-out mean reward"),
              "intermediate_values": ("held-out evaluation during RL (0 = the first after its start)",
                                      "held-out mean reward")}
    written = []
    for name in names:
        figure = getattr(plotly_plots, f"plot_{name}")(study)
        if name in labels:
            figure.update_layout(xaxis_title=labels[name][0], yaxis_title=labels[name][1])
        # "directory": the pages share one plotly.min.js beside them (no network needed to open them)
        figure.write_html(folder / f"{name}.html", include_plotlyjs="directory")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ExperimentalWarning)
            axes = getattr(mpl_plots, f"plot_{name}")(study)
        if name in labels:
            axes.set_xlabel(labels[name][0])
            axes.set_ylabel(labels[name][1])
        figure = axes.get_figure()
        figure.set_size_inches(8, 5)
        figure.tight_layout()
        figure.savefig(folder / f"{name}.png", dpi=100)
        plt.close(figure)
        written += [folder / f"{name}.html", folder / f"{name}.png"]
    return written


def _num(value, spec: str = ".4g") -> str:
    if value is None:
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def _read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    if not path.is_file():
        return []
    complete = path.read_text().split("\n")[:-1]  # a line still being written (a killed run's last) is left out
    return [json.loads(line) for line in complete if line.strip()]
