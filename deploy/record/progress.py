"""What a run shows and leaves behind: live progress, a summary table (and summary.json), metrics JSONL, a plot."""

import contextlib
import json
import pathlib
import time

from rich.console import Console
from rich.live import Live
from rich.table import Table

from deploy.record.performance import performance, performance_table
from deploy.record.run_state import Summary, write_summary


class JsonlTail:
    """The newest records of a JSONL file another process appends to (reads only what is new)."""

    def __init__(self, path: pathlib.Path):
        self.path, self.offset, self.last = path, 0, {}
        self.since_drain: list[dict] = []

    def latest(self) -> dict:
        if self.path.exists():
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
            complete = chunk[: chunk.rfind("\n") + 1]
            self.offset += len(complete.encode())
            records = [json.loads(line) for line in complete.splitlines() if line.strip()]
            if records:
                self.last = records[-1]
                self.since_drain.extend(records)
        return self.last

    def drain(self) -> list[dict]:
        """Every record read since the last drain."""
        self.latest()
        records, self.since_drain = self.since_drain, []
        return records


class Progress:
    """The run's progress on `console`: a live table on a terminal; without one (output to a file or a
    pipe, where a live table shows nothing until the end) one plain line every `line_interval_s`. The summary and
    the plot are titled by the run (`title`; default: its folder's name). `producer` names the stats file of what
    makes the samples: the driver's, or the episode runner's (runner_stats.jsonl) on an environment."""

    def __init__(self, run_dir: pathlib.Path, console: Console | None = None, line_interval_s: float = 10.0,
                 title: str | None = None, producer: str = "driver"):
        self.run_dir = run_dir
        self.title = title or f"relayrl run {run_dir.name}"
        self.console = console or Console()
        self.metrics_path = run_dir / "metrics.jsonl"
        self.trainer = JsonlTail(run_dir / "trainer_metrics.jsonl")
        self.driver = JsonlTail(run_dir / f"{producer}_stats.jsonl")
        self.live: Live | None = None
        self.line_interval_s, self.next_line, self.in_rl = line_interval_s, 0.0, False
        self.budget_s = 0.0
        self.accuracy = 0.0
        self.start_accuracy = 0.0

    @contextlib.contextmanager
    def phase(self, text: str):
        started = time.monotonic()
        if not self.console.is_terminal:  # a spinner shows nothing in a file: say what started
            self.console.print(text + " ...")
        with self.console.status(text + " ..."):
            yield
        self.console.print(f"[green]done[/] {text} ({time.monotonic() - started:.0f}s)")

    def note(self, text: str) -> None:
        self.console.print(text)

    def start_rl(self, budget_s: float, start_accuracy: float) -> None:
        self.budget_s, self.accuracy, self.start_accuracy = budget_s, start_accuracy, start_accuracy
        self.in_rl = True
        if self.console.is_terminal:
            self.live = Live(self._table(0.0), console=self.console, refresh_per_second=2, transient=False)
            self.live.start()
        else:
            self.next_line = 0.0
            self.refresh(0.0)

    def _fields(self, elapsed: float) -> dict[str, str]:
        t, d = self.trainer.latest(), self.driver.latest()
        return {
            "time": f"{elapsed:.0f}/{self.budget_s:.0f}s",
            "step": str(t.get("step", 0)),
            "reward": f"{t.get('reward_mean', d.get('mean_reward', 0.0)):.3f}",
            "held-out acc": f"{self.accuracy:.3f} (start {self.start_accuracy:.3f})",
            "staleness": f"{t.get('staleness_mean', 0.0):.2f} (max {t.get('staleness_max', 0):.0f})",
            "tokens/s": f"{d.get('tokens_per_s', 0.0):.0f}",
            "completions/s": f"{d.get('completions_per_s', 0.0):.1f}",
            "sync s": f"{t.get('publish_s', 0.0):.3f}",
        }

    def _table(self, elapsed: float) -> Table:
        fields = self._fields(elapsed)
        table = Table(title="asynchronous GRPO", show_header=True, header_style="bold")
        for col in fields:
            table.add_column(col, justify="right")
        table.add_row(*fields.values())
        return table

    def line(self, elapsed: float) -> str:
        """The progress as one plain line (what a console without a terminal gets)."""
        return "  ".join(f"{name} {value}" for name, value in self._fields(elapsed).items())

    def refresh(self, elapsed: float) -> None:
        if self.live is not None:
            self.live.update(self._table(elapsed))
        elif self.in_rl and elapsed >= self.next_line:  # no terminal: a plain line per interval
            self.next_line = elapsed + self.line_interval_s
            self.console.print(self.line(elapsed), markup=False, highlight=False, soft_wrap=True)

    def point(self, elapsed: float, accuracy: float, **details) -> dict:
        """Record one held-out evaluation with what the trainer and driver report at that moment (and the
        evaluation's `details`: an environment's success rate, mean reward and turns)."""
        self.accuracy = accuracy
        steps = self.trainer.drain()
        t, d = self.trainer.latest(), self.driver.latest()
        # Mean reward of every batch trained on since the previous point (one batch alone is noisy).
        rewards = [s["reward_mean"] for s in steps if "reward_mean" in s]
        point = {
            "elapsed_s": round(elapsed, 2), "accuracy": accuracy, "step": t.get("step", 0),
            "reward_mean": sum(rewards) / len(rewards) if rewards else None,
            "staleness_mean": t.get("staleness_mean"),
            "completions": d.get("samples", 0), "tokens_per_s": d.get("tokens_per_s"),
            "completions_per_s": d.get("completions_per_s"), "publish_s": t.get("publish_s"), **details,
        }
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(point) + "\n")
        self.refresh(elapsed)
        return point

    def close(self) -> None:
        """Stop the live table (idempotent; also after a failed run)."""
        self.in_rl = False
        if self.live is not None:
            self.live.stop()
            self.live = None

    def finish(self, summary: Summary) -> None:
        self.close()
        table = Table(title=f"{self.title}: summary" + (" (FAILED)" if summary.failure else ""), show_header=False)
        table.add_column("", style="bold")
        table.add_column("", justify="right")
        failed = [("FAILED: the run could not train", summary.failure)] if summary.failure else []
        for name, value in (
            *failed,
            ("seed", summary.seed),
            ("held-out accuracy, start of RL (after SFT)", _fraction(summary.sft_accuracy)),
            ("held-out accuracy, end of RL", _fraction(summary.final_accuracy)),
            ("best held-out accuracy", _fraction(summary.best_accuracy)),
            ("optimizer steps", summary.steps),
            ("completions generated", summary.completions),
            ("RL wall-clock", f"{summary.rl_seconds:.0f}s"),
            ("completions/s", f"{summary.completions / max(summary.rl_seconds, 1e-9):.1f}"),
            ("restarts", ", ".join(f"{name} {n}" for name, n in summary.restarts.items()) or "none"),
            ("plot", str(self.run_dir / "progress.png")),
            ("metrics", str(self.metrics_path)),
        ):
            table.add_row(name, str(value))
        self.console.print(table)
        summary.performance = performance(self.run_dir)
        if (stages := performance_table(summary.performance, f"{self.title}: where the time went")) is not None:
            self.console.print(stages)
        plot(summary.curve, self.run_dir / "progress.png", self.title)
        write_summary(self.run_dir, summary)  # last: the run is finished (deploy/record/run_state.py)


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def plot(curve: list[dict], path: pathlib.Path, title: str) -> None:
    """Held-out accuracy and mean training reward against wall-clock time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [p["elapsed_s"] for p in curve]
    ax.plot(xs, [p["accuracy"] for p in curve], marker="o", label="held-out greedy accuracy")
    rewards = [(p["elapsed_s"], p["reward_mean"]) for p in curve if p.get("reward_mean") is not None]
    if rewards:
        ax.plot(*zip(*rewards), marker=".", label="mean training reward (batches since previous point)")
    ax.set_xlabel("RL wall-clock (s)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(f"{title}: held-out metric and training reward")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
