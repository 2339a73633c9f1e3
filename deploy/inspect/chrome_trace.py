"""`relayrl trace RUN_DIR`: a window of the run's spans (RUN_DIR/traces/spans-*.jsonl, services/tracing.py) as a
Chrome / Perfetto trace (the JSON `traceEvents` format), which chrome://tracing and ui.perfetto.dev open offline.

Each service process is a process row (named by its service and pid), each trace a thread row inside it, so one
sample's spans in one process stack as they nested; a parent in another process is drawn as a flow arrow to its
child. Times are microseconds from the window's start.
"""

import json
import pathlib
import sys
from collections.abc import Iterable

TRACES = "traces"


def read_spans(run_dir: pathlib.Path) -> list[dict]:
    """Every span the run's processes wrote (a line cut short by a killed process is skipped)."""
    spans = []
    for path in sorted((run_dir / TRACES).glob("spans-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return spans


def window(spans: list[dict], start_s: float | None, seconds: float) -> tuple[list[dict], int]:
    """The spans overlapping [start, start + seconds] and the window's start in ns. `start_s` counts from the first
    span; None: the last `seconds` of the run."""
    first = min(span["start_ns"] for span in spans)
    last = max(span["end_ns"] for span in spans)
    begin = first + int(start_s * 1e9) if start_s is not None else max(first, last - int(seconds * 1e9))
    end = begin + int(seconds * 1e9)
    return [span for span in spans if span["end_ns"] >= begin and span["start_ns"] <= end], begin


def chrome_events(spans: Iterable[dict], origin_ns: int) -> list[dict]:
    """Complete ("X") events, process names, and flow arrows ("s" -> "f") from a parent in another process."""
    spans = list(spans)
    processes: dict[tuple[str, int], int] = {}
    threads: dict[tuple[int, str], int] = {}
    events: list[dict] = []
    placed: dict[str, tuple[int, int, float]] = {}  # span id -> (pid, tid, ts)

    def us(ns: int) -> float:
        return (ns - origin_ns) / 1000.0

    for span in sorted(spans, key=lambda s: s["start_ns"]):
        key = (span["service"], span["pid"])
        if key not in processes:
            processes[key] = len(processes) + 1
            events.append({"ph": "M", "name": "process_name", "pid": processes[key], "tid": 0,
                           "args": {"name": f"{span['service']} (pid {span['pid']})"}})
        pid = processes[key]
        tid = threads.setdefault((pid, span["trace_id"]), len(threads) + 1)
        events.append({"ph": "X", "name": span["name"], "cat": span["service"], "pid": pid, "tid": tid,
                       "ts": us(span["start_ns"]), "dur": max(0.0, (span["end_ns"] - span["start_ns"]) / 1000.0),
                       "args": {"trace_id": span["trace_id"], "span_id": span["span_id"], **span["attributes"]}})
        placed[span["span_id"]] = (pid, tid, us(span["start_ns"]))
    flow = 0
    for span in spans:
        parent = placed.get(span.get("parent_span_id") or "")
        child = placed[span["span_id"]]
        if parent is None or parent[0] == child[0]:
            continue
        flow += 1
        events.append({"ph": "s", "id": flow, "name": "calls", "cat": "flow", "pid": parent[0], "tid": parent[1],
                       "ts": parent[2]})
        events.append({"ph": "f", "bp": "e", "id": flow, "name": "calls", "cat": "flow", "pid": child[0],
                       "tid": child[1], "ts": child[2]})
    return events


def write_chrome_trace(run_dir: pathlib.Path, out: pathlib.Path, start_s: float | None = None,
                       seconds: float = 60.0) -> int:
    """Write the window as a Chrome trace to `out`; the number of spans in it."""
    spans = read_spans(run_dir)
    if not spans:
        raise FileNotFoundError(f"{run_dir / TRACES}: no spans (the run traced nothing: tracing.sample_rate 0, or a "
                                "run from before tracing)")
    chosen, origin = window(spans, start_s, seconds)
    out.write_text(json.dumps({"traceEvents": chrome_events(chosen, origin), "displayTimeUnit": "ms"}))
    return len(chosen)


def main(run_dir: str, out: str | None, start_s: float | None, seconds: float) -> int:
    folder = pathlib.Path(run_dir)
    target = pathlib.Path(out) if out else folder / "trace.json"
    try:
        count = write_chrome_trace(folder, target, start_s, seconds)
    except FileNotFoundError as exc:
        print(f"relayrl trace: {exc}", file=sys.stderr)
        return 2
    print(f"{target}: {count} spans; open it in https://ui.perfetto.dev or chrome://tracing (both read it offline)")
    return 0
