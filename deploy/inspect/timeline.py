"""`relayrl view`'s timeline: a few trainer steps across the services, from the run's spans (RUN_DIR/traces).

The window holds the last `steps` trainer steps (their own `trainer.step` spans, services/tracing.py) and the lives
of the samples they consumed (the traces their span links name: admission, generate with the engine's queue /
prefill / decode, score, put, lease, train, ack), from the earliest of those, or the end of the step before, to
the latest. Every span overlapping it is placed on its process's lane, in rows so that none overlaps another
(the first row free at its start); a span of a consumed sample's trace is marked so the page can highlight it.
"""

import pathlib

from deploy.inspect.chrome_trace import read_spans

MAX_SPANS = 4000  # the most a page draws: the latest spans in the window are kept


def timeline(run_dir: pathlib.Path, steps: int = 3) -> dict:
    """{"steps": [...], "lanes": [{"service", "pid", "rows", "spans": [...]}], "window_ms"}; times in ms from the
    window's start. Empty lanes (and a `note`) when the run traced no trainer step."""
    spans = read_spans(run_dir)
    trained = sorted((s for s in spans if s["name"] == "trainer.step" and s["parent_span_id"] is None),
                     key=lambda s: s["start_ns"])
    if not trained:
        return {"steps": [], "lanes": [], "window_ms": 0.0,
                "note": "no traced trainer step in RUN_DIR/traces (tracing off, or no traced sample trained yet)"}
    chosen = trained[-steps:]
    consumed = {link["trace_id"] for step in chosen for link in step["links"]}
    lives = [s for s in spans if s["trace_id"] in consumed]
    before = trained[-steps - 1]["end_ns"] if len(trained) > steps else None
    begin = min([s["start_ns"] for s in lives] + [chosen[0]["start_ns"]] + ([before] if before else []))
    end = max([s["end_ns"] for s in lives] + [chosen[-1]["end_ns"]])
    inside = sorted((s for s in spans if s["end_ns"] >= begin and s["start_ns"] <= end), key=lambda s: s["start_ns"])
    inside = inside[-MAX_SPANS:]

    def ms(ns: int) -> float:
        return round((ns - begin) / 1e6, 3)

    lanes: dict[tuple[str, int], dict] = {}
    row_ends: dict[tuple[str, int], list[int]] = {}
    for span in inside:
        key = (span["service"], span["pid"])
        lane = lanes.setdefault(key, {"service": span["service"], "pid": span["pid"], "spans": []})
        ends = row_ends.setdefault(key, [])
        row = next((i for i, last in enumerate(ends) if last <= span["start_ns"]), len(ends))
        if row == len(ends):
            ends.append(0)
        ends[row] = span["end_ns"]
        lane["spans"].append({"name": span["name"], "start_ms": ms(span["start_ns"]),
                              "dur_ms": round((span["end_ns"] - span["start_ns"]) / 1e6, 3), "row": row,
                              "trace_id": span["trace_id"], "consumed": span["trace_id"] in consumed})
    order = {"driver": 0, "rollout": 1, "reward": 2, "buffer": 3, "trainer": 4}
    ordered = sorted(lanes.values(), key=lambda lane: (order.get(lane["service"], 5), lane["service"], lane["pid"]))
    for lane in ordered:
        lane["rows"] = len(row_ends[(lane["service"], lane["pid"])])
    return {
        "steps": [{"first_step": step["attributes"].get("first_step"), "last_step": step["attributes"].get("last_step"),
                   "samples": step["attributes"].get("samples"), "start_ms": ms(step["start_ns"]),
                   "end_ms": ms(step["end_ns"])} for step in chosen],
        "lanes": ordered, "window_ms": ms(end),
    }
