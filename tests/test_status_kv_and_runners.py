"""`relayrl status` shows what issue 39 asks to be visible: a rollout's host KV tier (hits and restored tokens, as
rates) and sessions queued for admission, from its Prometheus page; an agentic run's episodes played again and groups
dropped, by cause, from its runners' stats (each runner's last line)."""

import json

from deploy.inspect.status_table import _caption, report, runner_summary
from deploy.record.status import Poll, _from_metrics, _rates


def page(hits: float, restored: float, queued: float, moved: float = 0.0, longest_wait: float = 0.0) -> dict:
    return {("relayrl_rollout_running_sequences", ()): 3.0, ("relayrl_rollout_waiting_sequences", ()): 1.0,
            ("relayrl_rollout_generated_tokens_total", ()): 500.0, ("relayrl_rollout_session_tier_hits", ()): hits,
            ("relayrl_rollout_session_tier_tokens_restored", ()): restored, ("relayrl_rollout_sessions_queued", ()): queued,
            ("relayrl_rollout_session_tier_bytes_in", ()): moved / 2, ("relayrl_rollout_session_tier_bytes_out", ()): moved / 2,
            ("relayrl_rollout_session_admission_max_wait_s", ()): longest_wait}


def test_a_rollouts_tier_and_admission_queue_are_read_from_its_metrics():
    before, after = Poll(100.0, "rollout", "SERVING"), Poll(102.0, "rollout", "SERVING")
    _from_metrics(before, page(hits=4, restored=400, queued=0))
    _from_metrics(after, page(hits=10, restored=1000, queued=2, moved=8000, longest_wait=2.25))
    assert after.queue == {"running": 3, "waiting": 1, "sessions queued": 2, "longest admission wait s": 2.2}
    rates = _rates(before, after)
    assert rates["tier hits"] == 3.0 and rates["tier tokens restored"] == 300.0 and rates["tier bytes moved"] == 4000.0
    quiet = Poll(0.0, "rollout", "SERVING")
    _from_metrics(quiet, page(hits=0, restored=0, queued=0))
    assert "tier hits" not in quiet.counters and "sessions queued" not in quiet.queue  # no tier: no column noise


def test_an_agentic_runs_replays_and_drops_by_cause(tmp_path):
    lines = [
        {"producer_id": "a", "episodes": 5, "replays_by_cause": {"env_error": 1}, "drops_by_cause": {}},
        {"producer_id": "a", "episodes": 9, "replays_by_cause": {"env_error": 2, "deadline": 1},
         "drops_by_cause": {"env_error": 1}},
        {"producer_id": "b", "episodes": 4, "replays_by_cause": {"deadline": 1}, "drops_by_cause": {}},
    ]
    (tmp_path / "runner_stats.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"cut')
    runner = runner_summary(tmp_path)
    assert runner == {"episodes": 13, "replays_by_cause": {"env_error": 2, "deadline": 2},
                      "drops_by_cause": {"env_error": 1}}
    assert report([], None, runner)["runner"] == runner
    caption = _caption({"step": 7, "weight_version": 7}, runner)
    assert "trainer: step 7" in caption
    assert "13 episodes; played again 4 (env_error 2, deadline 2); groups dropped 1 (env_error 1)" in caption
    assert runner_summary(tmp_path / "elsewhere") is None and _caption(None, None) is None
