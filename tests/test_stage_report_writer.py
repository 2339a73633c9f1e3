"""services/stage_reports.py: the intervals a service's report writer writes out."""

import json
import os
import time

from services.config import StageReportConfig
from services.stage_reports import StageReportWriter


def test_work_before_the_writer_is_left_out_and_work_while_the_peak_is_probed_is_kept(tmp_path):
    """The first interval starts when the writer is made (before the service serves), not after its FLOP-peak
    probe: a request served while the probe runs is in the reports."""
    served = {"requests": 5}  # the start-up's: no interval's

    def report() -> dict:
        requests, served["requests"] = served["requests"], 0
        return {"stage/busy_s": 0.0, "stage/interval_s": 0.0, "x/requests": requests}

    def slow_probe() -> float:
        time.sleep(0.3)
        return 1.0

    writer = StageReportWriter("svc", StageReportConfig(dir=str(tmp_path), interval_s=0.1), report, slow_probe)
    served["requests"] += 1  # served right after start, while the probe runs
    time.sleep(0.6)
    writer.stop()
    lines = [json.loads(line) for line in (tmp_path / f"svc-{os.getpid()}.jsonl").read_text().splitlines()]
    assert len(lines) >= 2 and sum(line["x/requests"] for line in lines) == 1
    times = [line["stage/report_time"] for line in lines]
    assert times == sorted(times)
