"""Scoring: reward functions by name (registry, match, math, code, model), the code sandbox
(sandbox, jail, code_harness), the worker processes that run functions (workers, scorer) and
the reward gRPC service (service)."""
