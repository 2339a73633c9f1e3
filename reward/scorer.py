"""Scoring a batch: per-sample timeouts, bounded concurrency, and failures kept per sample.

A sample whose function raises, hangs past its timeout or kills its worker comes back FAILED
with a reason; the rest of the batch is scored as usual. Only request-level problems (an unknown
function, arguments that do not fit it) fail the whole call.

Built-ins marked `inline` (exact and numeric match) score responses of up to `inline_max_chars`
characters in this process: a worker round trip costs more than such a check (milliseconds of
IPC against microseconds). Longer responses, and every other function, go to the workers.

LLM judges (reward/judge.py) run in this process's asyncio loop too: they wait on an HTTP endpoint, and
a worker process per request would only add a hop.
"""

import asyncio
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from protos.sample import Sample, SampleStatus
from reward.judge import Judge, JudgeError
from reward.metrics import FAILURES, LATENCY, SCORES
from reward.registry import BadFunction, Registry, RewardSpec, call_args, check_args, load
from reward.workers import Call, Reply, WorkerDied, WorkerPool, run_function


@dataclass
class ScoreOutcome:
    """One sample's result."""

    reward: float
    details: dict[str, float] = field(default_factory=dict)
    status: SampleStatus = SampleStatus.COMPLETED
    reason: str = ""

    @classmethod
    def failed(cls, reason: str) -> "ScoreOutcome":
        return cls(0.0, {}, SampleStatus.FAILED, reason)


class FunctionUnavailable(RuntimeError):
    """A function could not be loaded or prepared (timeout, a reward model that fails to load)."""


@dataclass
class ScorerSettings:
    """How the scorer runs functions (filled from the service Config)."""

    # Worker processes for per-sample functions = how many samples are scored at once.
    max_concurrency: int = 2
    # Worker processes for batched functions (reward models); each holds its own model copy.
    model_workers: int = 1
    # torch/OpenMP threads per worker process.
    threads_per_worker: int = 1
    # Samples per call to a batched function; the timeout applies to each such chunk.
    batch_chunk: int = 64
    # How long a worker may take to import a function, check its arguments and run its prepare
    # hook (first use loads math-verify, torch, a reward model).
    load_timeout_s: float = 120.0
    # `inline` functions score responses up to this many characters in the server process (their
    # run time grows with the text, so the cap bounds it); 0 = always in workers.
    inline_max_chars: int = 4096


class Scorer:
    """Resolves functions by name and scores samples with them in worker processes."""

    def __init__(self, registry: Registry, settings: ScorerSettings, allow_custom: bool = False,
                 judges: Mapping[str, Judge] | None = None):
        self.registry, self.settings, self.allow_custom = registry, settings, allow_custom
        self.judges = dict(judges or {})  # function name -> judge (its spec is in the registry too)
        self.sample_pool = WorkerPool(settings.max_concurrency, "reward", settings.threads_per_worker,
                                      settings.load_timeout_s)
        self.batch_pool = WorkerPool(settings.model_workers, "reward-model", settings.threads_per_worker,
                                     settings.load_timeout_s)

    def start(self) -> None:
        self.sample_pool.start()
        self.batch_pool.start()

    def close(self) -> None:
        self.sample_pool.close()
        self.batch_pool.close()

    def resolve(self, name: str) -> RewardSpec:
        """The spec for a function name; raises registry.UnknownFunction."""
        return self.registry.get(name, allow_custom=self.allow_custom)

    def _pool(self, spec: RewardSpec) -> WorkerPool:
        return self.batch_pool if spec.batched else self.sample_pool

    def _runs_inline(self, spec: RewardSpec, sample: Sample) -> bool:
        return spec.inline and not spec.batched and len(sample.response_text) <= self.settings.inline_max_chars

    async def check(self, spec: RewardSpec, request_args: Mapping[str, Any]) -> dict[str, Any]:
        """The full arguments for `spec`, checked against its signature in a worker.

        Raises BadFunction (cannot import, bad arguments) or FunctionUnavailable (load timeout,
        a failing prepare hook).
        """
        args = call_args(spec, request_args)
        if spec.name in self.judges:
            if request_args:
                raise BadFunction(f"function {spec.name!r}: an LLM judge takes no function_args (its server "
                                  "config fixes them)")
            return {}
        if spec.inline:
            check_args(spec, load(spec), args)  # a long response may still go to a worker, which checks again
            return args
        try:
            reply = await self._pool(spec).call(Call("check", spec, args, []), self.settings.load_timeout_s)
        except (TimeoutError, WorkerDied) as exc:
            raise FunctionUnavailable(f"function {spec.name!r} did not load: {exc or 'timeout'}") from None
        if reply.kind == "bad_function":
            raise BadFunction(reply.message)
        if reply.kind == "unavailable":
            raise FunctionUnavailable(reply.message)
        return args

    async def score(self, samples: list[Sample], spec: RewardSpec, args: Mapping[str, Any],
                    timeout_s: float) -> list[ScoreOutcome]:
        """One outcome per sample, in order. `args` come from `check`."""
        outcomes: list[ScoreOutcome | None] = [None] * len(samples)
        todo = []
        for i, sample in enumerate(samples):
            if sample.status == SampleStatus.FAILED:
                outcomes[i] = ScoreOutcome.failed(f"not scored: generation failed ({sample.reason})")
                FAILURES.labels(spec.name, "not_scored").inc()
            elif self._runs_inline(spec, sample):
                outcomes[i] = self._score_inline(sample, spec, args)
            else:
                todo.append(i)
        judge = self.judges.get(spec.name)
        if judge is not None:
            judged = await asyncio.gather(*(self._judge(judge, spec, samples[i], timeout_s) for i in todo))
            for i, outcome in zip(todo, judged):
                outcomes[i] = outcome
            return outcomes  # type: ignore[return-value]
        size = self.settings.batch_chunk if spec.batched else 1
        chunks = [todo[start:start + size] for start in range(0, len(todo), size)]
        results = await asyncio.gather(*(self._score_chunk([samples[i] for i in chunk], spec, args, timeout_s)
                                         for chunk in chunks))
        for chunk, chunk_outcomes in zip(chunks, results):
            for i, outcome in zip(chunk, chunk_outcomes):
                outcomes[i] = outcome
        return outcomes  # type: ignore[return-value]

    def _score_inline(self, sample: Sample, spec: RewardSpec, args: Mapping[str, Any]) -> ScoreOutcome:
        start = time.perf_counter()
        reply = run_function(spec, load(spec), [sample], args)
        LATENCY.labels(spec.name).observe(time.perf_counter() - start)
        return self._outcomes(spec, [sample], reply)[0]

    async def _judge(self, judge: Judge, spec: RewardSpec, sample: Sample, timeout_s: float) -> ScoreOutcome:
        start = time.perf_counter()
        try:
            output = await judge.score(sample, timeout_s)
        except TimeoutError:
            return self._failed(spec, [sample], "timeout", f"timeout after {timeout_s:g}s waiting for judge "
                                f"{judge.name!r} at {judge.endpoint}")[0]
        except JudgeError as exc:
            return self._failed(spec, [sample], "judge_error", str(exc))[0]
        finally:
            LATENCY.labels(spec.name).observe(time.perf_counter() - start)
        SCORES.labels(spec.name).observe(output.score)
        return ScoreOutcome(output.score, output.details, SampleStatus.COMPLETED, output.note)

    async def _score_chunk(self, samples: list[Sample], spec: RewardSpec, args: Mapping[str, Any],
                           timeout_s: float) -> list[ScoreOutcome]:
        start = time.perf_counter()
        try:
            reply = await self._pool(spec).call(Call("score", spec, args, samples), timeout_s)
        except TimeoutError:
            return self._failed(spec, samples, "timeout", f"timeout after {timeout_s:g}s")
        except WorkerDied as exc:
            return self._failed(spec, samples, "worker_died", f"reward worker died: {exc}")
        finally:
            LATENCY.labels(spec.name).observe(time.perf_counter() - start)
        return self._outcomes(spec, samples, reply)

    def _outcomes(self, spec: RewardSpec, samples: list[Sample], reply: Reply) -> list[ScoreOutcome]:
        if reply.kind != "ok":
            return self._failed(spec, samples, "error", reply.message)
        for output in reply.outputs:
            SCORES.labels(spec.name).observe(output.score)
        return [ScoreOutcome(output.score, output.details, SampleStatus.COMPLETED, output.note)
                for output in reply.outputs]

    @staticmethod
    def _failed(spec: RewardSpec, samples: list[Sample], kind: str, reason: str) -> list[ScoreOutcome]:
        FAILURES.labels(spec.name, kind).inc(len(samples))
        return [ScoreOutcome.failed(reason) for _ in samples]


def check_timeout(timeout_s: float, default_s: float, max_s: float) -> float:
    """The per-sample timeout of a request: 0 means the default; it must be finite, > 0 and <= max_s."""
    if timeout_s == 0:
        return default_s
    if not math.isfinite(timeout_s) or timeout_s < 0 or timeout_s > max_s:
        raise ValueError(f"timeout_s: must be 0 (server default) or in (0, {max_s:g}], got {timeout_s}")
    return timeout_s
