"""Code execution reward: run the response's code against the task's tests in the sandbox.

`sample.metadata[tests_key]` (default "tests") is either
- assert tests: a string or a list of strings, each run after the solution in its namespace
  (e.g. "assert add(2, 3) == 5"); or
- stdin/stdout tests: a list of {"input": str, "output": str}; the solution runs once per case
  and passes when its stdout matches (trailing whitespace ignored).
The score is the fraction of tests passed.
"""

import json
import pathlib
import re
import secrets
from typing import Any, Literal, NamedTuple

from protos.sample import Sample
from reward.registry import RewardOutput
from reward.sandbox import SandboxLimits, run_python

HARNESS = pathlib.Path(__file__).with_name("code_harness.py")
_REPORTED = ("network_cut", "readonly_fs", "pid_namespace", "uid_drop", "user_namespace")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.DOTALL)


def extract_code(text: str, how: Literal["auto", "none"] = "auto") -> str:
    """The last ```python (or untagged) fenced block of a response; the whole text when there is none."""
    if how == "none":
        return text
    if how != "auto":
        raise ValueError(f"extract must be 'auto' or 'none', got {how!r}")
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(text)]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3", "")]
    return python[-1] if python else text


def _tests(sample: Sample, key: str) -> list[str] | list[dict[str, str]]:
    if key not in sample.metadata:
        raise ValueError(f"metadata[{key!r}] is missing: no tests to run")
    tests: Any = sample.metadata[key]
    if isinstance(tests, str):
        return [tests]
    if isinstance(tests, list) and tests and all(isinstance(t, str) for t in tests):
        return tests
    if isinstance(tests, list) and tests and all(
        isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str) for t in tests
    ):
        return tests
    raise ValueError(f"metadata[{key!r}] must be a string, a list of strings, or a list of "
                     "{'input': str, 'output': str}")


def _last_line(text: bytes | str, limit: int = 200) -> str:
    """The last non-empty line (of a traceback: the exception)."""
    text = text.decode(errors="replace") if isinstance(text, bytes) else text
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


class SolutionRun(NamedTuple):
    """How a solution fared against its tests."""

    passed: int
    failure: str  # why the first failing test failed ("" when all passed)
    timed_out: bool  # a run hit the wall-clock limit
    isolation: dict[str, object]  # the sandbox's report


def run_assert_tests(code: str, tests: list[str], limits: SandboxLimits) -> SolutionRun:
    """Run the solution, then each assert test in its namespace, in one sandboxed process."""
    nonce = secrets.token_hex(16)
    files = {"solution.py": code, "harness.py": HARNESS.read_text(),
             "spec.json": json.dumps({"nonce": nonce, "tests": tests})}
    result = run_python(files, "harness.py", limits)
    passed: set[int] = set()
    failure = ""
    for line in result.channel.decode(errors="replace").splitlines():
        if not line.startswith(f'["{nonce}"'):
            continue  # not from the harness
        try:
            _, kind, index, text = json.loads(line)
        except ValueError:
            continue  # a line cut short when the run was killed
        if kind == "pass":
            passed.add(index)
        elif kind in ("fail", "solution_error") and not failure:
            failure = f"test {index}: {text}" if kind == "fail" else f"solution raised {text}"
    if len(passed) < len(tests) and not failure:
        failure = f"the run ended before the tests finished ({result.describe()})" + (
            f": {_last_line(result.stderr)}" if result.stderr.strip() else "")
    return SolutionRun(len(passed), failure, result.timed_out, result.isolation)


def run_io_tests(code: str, tests: list[dict[str, str]], limits: SandboxLimits) -> SolutionRun:
    """Run the solution once per case with its input; a case passes when the output matches."""
    passed, failure = 0, ""
    results = []
    for index, case in enumerate(tests):
        result = run_python({"solution.py": code}, "solution.py", limits, stdin=case["input"].encode())
        results.append(result)
        got = result.stdout.decode(errors="replace")
        if result.returncode == 0 and _same_output(got, case["output"]):
            passed += 1
        elif not failure:
            why = result.describe() if result.returncode != 0 else f"wrong output {_last_line(got, 60)!r}"
            stderr = _last_line(result.stderr)
            failure = f"case {index}: {why}" + (f" ({stderr})" if stderr and result.returncode != 0 else "")
    return SolutionRun(passed, failure, any(r.timed_out for r in results), results[-1].isolation)


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _same_output(got: str, expected: str) -> bool:
    return _lines(got) == _lines(expected)


def code_exec(
    sample: Sample,
    *,
    tests_key: str = "tests",
    extract: Literal["auto", "none"] = "auto",
    timeout_s: float = 10.0,
    cpu_s: int = 5,
    memory_mb: int = 1024,
    max_processes: int = 32,
) -> RewardOutput:
    """Fraction of the task's tests the response's code passes, run in the sandbox.

    `timeout_s`, `cpu_s`, `memory_mb`, `max_processes` bound each sandboxed run (see SandboxLimits).
    """
    tests = _tests(sample, tests_key)
    limits = SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_processes=max_processes)
    code = extract_code(sample.response_text, extract)
    if isinstance(tests[0], str):
        run = run_assert_tests(code, tests, limits)  # type: ignore[arg-type]
    else:
        run = run_io_tests(code, tests, limits)  # type: ignore[arg-type]
    total = len(tests)
    details = {"passed": float(run.passed), "total": float(total), "pass_rate": run.passed / total,
               "timed_out": float(run.timed_out)}
    # Which confinement measures held on this machine (1.0 = in force).
    details.update({f"sandbox_{k}": float(v) for k, v in run.isolation.items() if k in _REPORTED})
    note = f"{run.passed}/{total} tests passed" + (f"; {run.failure}" if run.failure else "")
    return RewardOutput(run.passed / total, details, note=note)
