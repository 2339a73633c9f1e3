"""Progress without a terminal: one plain line per interval, from what the trainer and the driver write."""

import io
import json

from rich.console import Console

from deploy.record.progress import Progress


def append(path, record: dict) -> None:
    with open(path, "a") as out:
        out.write(json.dumps(record) + "\n")


def test_without_a_terminal_a_plain_line_is_printed_every_interval(tmp_path):
    out = io.StringIO()
    console = Console(file=out, width=200)
    assert not console.is_terminal
    progress = Progress(tmp_path, console, line_interval_s=10.0)
    append(tmp_path / "trainer_metrics.jsonl", {"step": 1, "reward_mean": 0.125, "staleness_mean": 0.5,
                                                 "staleness_max": 1, "publish_s": 0.012})
    append(tmp_path / "driver_stats.jsonl", {"samples": 64, "tokens_per_s": 812.4, "completions_per_s": 40.2})
    progress.start_rl(budget_s=360.0, start_accuracy=0.25)
    assert progress.live is None
    progress.refresh(5.0)  # within the interval: nothing new
    append(tmp_path / "trainer_metrics.jsonl", {"step": 7, "reward_mean": 0.375, "staleness_mean": 0.75,
                                                 "staleness_max": 1, "publish_s": 0.02})
    progress.refresh(10.5)
    progress.point(12.0, accuracy=0.5)  # an evaluation between lines is in the next one
    progress.refresh(19.0)
    progress.refresh(20.6)
    progress.close()

    lines = out.getvalue().splitlines()
    assert lines == [
        ("time 0/360s  step 1  reward 0.125  held-out acc 0.250 (start 0.250)  staleness 0.50 (max 1)  "
         "tokens/s 812  completions/s 40.2  sync s 0.012"),
        ("time 10/360s  step 7  reward 0.375  held-out acc 0.250 (start 0.250)  staleness 0.75 (max 1)  "
         "tokens/s 812  completions/s 40.2  sync s 0.020"),
        ("time 21/360s  step 7  reward 0.375  held-out acc 0.500 (start 0.250)  staleness 0.75 (max 1)  "
         "tokens/s 812  completions/s 40.2  sync s 0.020"),
    ]
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["accuracy"] == 0.5


def test_on_a_terminal_the_table_is_live(tmp_path):
    out = io.StringIO()
    progress = Progress(tmp_path, Console(file=out, force_terminal=True, width=200), line_interval_s=10.0)
    progress.start_rl(budget_s=60.0, start_accuracy=0.0)
    assert progress.live is not None
    progress.refresh(30.0)
    progress.close()
    assert "time 30/60s" not in out.getvalue()  # a table, not the plain line
    assert "asynchronous GRPO" in out.getvalue()
