"""Prometheus metrics of the reward service (the RPC counters come from services.metrics)."""

from prometheus_client import Counter, Histogram

SCORES = Histogram(
    "relayrl_reward_score",
    "Scores returned, by reward function",
    ["function"],
    buckets=(-10, -1, -0.5, 0, 0.1, 0.25, 0.5, 0.75, 0.9, 1, 2, 10),
)
FAILURES = Counter(
    "relayrl_reward_failures_total",
    "Samples that came back FAILED, by function and kind (timeout, error, worker_died, not_scored, judge_error)",
    ["function", "kind"],
)
LATENCY = Histogram(
    "relayrl_reward_call_seconds",
    "Time to score one sample (or one chunk of a batched function), waiting for a free worker included",
    ["function"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
JUDGE_UNPARSED = Counter(
    "relayrl_reward_judge_unparsed_total",
    "Samples an LLM judge graded with a verdict that could not be read (scored 0), by judge",
    ["function"],
)
