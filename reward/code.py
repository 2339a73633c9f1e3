"""Code execution reward: run the response's code in the sandbox, judge its outputs outside it.

The judge (this code, in the reward worker) holds every test's expected output; the solution runs
in a separate sandboxed process (reward/sandbox.py) and shares no memory and no descriptor with
the judge but the stdin, stdout and stderr files of that process. What crosses back is plain
text: a stdin/stdout test's output, or the JSON of each call's value, printed by the harness
(reward/code_harness.py) that runs the solution; the judge parses and compares it. So the score
is the fraction of tests for which the solution's code produced the expected output, whatever else
it does in its process: reading the harness's frames, printing fake result lines, exiting early,
patching builtins or json, or returning an object whose __eq__ is always true (not JSON: a failure).

`sample.metadata[tests_key]` (default "tests") holds the tests (reward/code_tests.py has the
details): stdin/stdout tests [{"input": str, "output": str}] (trailing whitespace ignored), call
tests [{"call": "add(2, 3)", "expected": 5}], or assert strings ("assert add(2, 3) == 5"), which
are converted into call tests where their shape allows (`EXPR == LITERAL`, `EXPR is None`,
`f(...)`, `not f(...)`).

The weaker mode: `assert_mode="in_process"` runs the asserts that cannot be converted
("assert abs(f(1) - 0.5) < 1e-9") inside the solution's process, where the harness reports whether
they raised; the solution can forge those results. Off by default (such a test is then an error,
so the sample is FAILED with the reason); `details["in_process_tests"]` counts them when it is on.
The score is the fraction of tests passed.
"""

import json
import pathlib
import re
from typing import Any, Literal, NamedTuple

from protos.sample import Sample
from reward.code_tests import AssertMode, CallTest, InProcessTest, IoTest, Test, parse_tests, same_value
from reward.registry import RewardOutput
from reward.sandbox import SandboxLimits, SandboxResult, run_python

HARNESS = pathlib.Path(__file__).with_name("code_harness.py")
# The sandbox's measures reported in details as sandbox_<name> (1.0 = in force on this machine).
_REPORTED = ("network_cut", "readonly_fs", "minimal_root", "private_proc", "pid_namespace", "uid_drop",
             "user_namespace", "seccomp", "no_new_privs", "caps_dropped", "memory_cgroup", "memory_rlimit")
_OUTPUT_BYTES = 1 << 20  # the stdout kept per run: room for the values of many call tests
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


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not plain data")


def _reports(stdout: bytes, count: int) -> dict[int, list[list]]:
    """The harness's lines by test index (-1: the solution raised); anything else is ignored."""
    found: dict[int, list[list]] = {}
    for line in stdout.decode(errors="replace").splitlines():
        try:
            record = json.loads(line, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            continue  # not a result line (or one cut short when the run was killed)
        if isinstance(record, list) and record and type(record[0]) is int and -1 <= record[0] < count:
            found.setdefault(record[0], []).append(record)
    return found


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _verdict(test: Test, records: list[list]) -> str | None:
    """"" when the test passed, why not otherwise; None when no result came (the run ended first)."""
    if not records:
        return None
    if len(records) > 1:
        return "reported more than once"
    record = records[0]
    if len(record) == 3 and record[1] == "error" and isinstance(record[2], str):
        return record[2]
    if isinstance(test, InProcessTest):
        return "" if len(record) == 2 and record[1] == "pass" else "malformed result"
    if len(record) != 3 or record[1] != "value":
        return "malformed result"
    got = record[2]
    if same_value(got, test):
        return ""
    if test.as_bool:
        return f"{test.call} is {_short(got)}, expected {_short(test.expected)}"
    return f"{test.call} returned {_short(got)}, expected {_short(test.expected)}"


def run_call_tests(code: str, tests: list[Test], limits: SandboxLimits) -> SolutionRun:
    """Run the solution and every test's expression in one sandboxed process; judge the values here."""
    spec = [{"call": t.call, "as_bool": t.as_bool} if isinstance(t, CallTest) else {"exec": t.code} for t in tests]
    files = {"solution.py": code, "harness.py": HARNESS.read_text(), "spec.json": json.dumps({"tests": spec})}
    result = run_python(files, "harness.py", limits)
    reports = _reports(result.stdout, len(tests))
    passed, failure, unfinished = 0, "", None
    for index, test in enumerate(tests):
        verdict = _verdict(test, reports.get(index, []))
        if verdict == "":
            passed += 1
        elif verdict is None:
            unfinished = index if unfinished is None else unfinished
        elif not failure:
            failure = f"test {index}: {verdict}"
    if unfinished is not None and not failure:
        failure = _unfinished(unfinished, reports.get(-1, []), result)
    return SolutionRun(passed, failure, result.timed_out, result.isolation)


def _unfinished(index: int, solution_errors: list[list], result: SandboxResult) -> str:
    errors = [r[2] for r in solution_errors if len(r) == 3 and isinstance(r[2], str)]
    if errors:
        return f"solution raised {errors[0]}"
    return f"the run ended before test {index} finished ({result.describe()})" + (
        f": {_last_line(result.stderr)}" if result.stderr.strip() else "")


def run_io_tests(code: str, tests: list[IoTest], limits: SandboxLimits) -> SolutionRun:
    """Run the solution once per case with its input; a case passes when the output matches."""
    passed, failure = 0, ""
    results = []
    for index, case in enumerate(tests):
        result = run_python({"solution.py": code}, "solution.py", limits, stdin=case.input.encode())
        results.append(result)
        got = result.stdout.decode(errors="replace")
        if result.returncode == 0 and _same_output(got, case.output):
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
    assert_mode: AssertMode = "judge",
) -> RewardOutput:
    """Fraction of the task's tests the response's code passes, run in the sandbox, judged outside it.

    `timeout_s`, `cpu_s`, `memory_mb`, `max_processes` bound each sandboxed run (see SandboxLimits).
    `assert_mode="in_process"` lets asserts that cannot be judged outside run inside the
    solution's process (forgeable; see the module docstring); by default they are an error.
    """
    limits = SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_processes=max_processes,
                           max_output_bytes=_OUTPUT_BYTES)
    if tests_key not in sample.metadata:
        raise ValueError(f"metadata[{tests_key!r}] is missing: no tests to run")
    tests = parse_tests(sample.metadata[tests_key], tests_key, assert_mode)
    code = extract_code(sample.response_text, extract)
    if isinstance(tests[0], IoTest):
        run = run_io_tests(code, tests, limits)  # type: ignore[arg-type]
    else:
        run = run_call_tests(code, tests, limits)  # type: ignore[arg-type]
    total = len(tests)
    details = {"passed": float(run.passed), "total": float(total), "pass_rate": run.passed / total,
               "timed_out": float(run.timed_out),
               "in_process_tests": float(sum(isinstance(t, InProcessTest) for t in tests))}
    # Which confinement measures held on this machine (1.0 = in force).
    details.update({f"sandbox_{k}": float(v) for k, v in run.isolation.items() if k in _REPORTED})
    note = f"{run.passed}/{total} tests passed" + (f"; {run.failure}" if run.failure else "")
    return RewardOutput(run.passed / total, details, note=note)
