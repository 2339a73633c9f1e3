"""Runs inside the sandbox (standard library only): execute a solution, then each test against it,
and print what each test produced, one JSON line per test, for the judge outside to decide.

spec.json in the working directory lists the tests: {"call": EXPR, "as_bool": B} evaluates EXPR in
the solution's namespace and prints [index, "value", json of the value (of bool(value) when B)];
{"exec": CODE} (the weak in-process mode) runs CODE and prints [index, "pass"]; a test that raises
(or whose value JSON cannot carry) prints [index, "error", "Type: message"]; a solution that raises
prints [-1, "error", ...]. Expected values never come here. A line is printed as soon as its test
ends, so tests before one that hangs still count.

The solution shares this process and can print anything, to any descriptor: the judge reads these
lines as nothing more than values the solution's code produced, and fails a test reported twice.
The solution's own prints go to stderr, so that honest output never mixes with these lines.
"""

import json
import os


def describe(exc: BaseException) -> str:
    """"Type: message" of an exception raised by the solution (whose __str__ may raise as well)."""
    try:
        return f"{type(exc).__name__}: {exc}"[:300]
    except Exception:  # noqa: BLE001
        return type(exc).__name__[:300]


def main() -> None:
    with open("spec.json") as f:
        tests = json.load(f)["tests"]
    with open("solution.py") as f:
        source = f.read()
    results = os.dup(1)
    os.dup2(2, 1)
    dumps, write = json.dumps, os.write  # bound before the solution runs: honest code may shadow them
    namespace = {"__name__": "solution"}
    # Running the untrusted code is the point (inside the sandbox); whatever it raises,
    # SystemExit and MemoryError included, is its result.
    try:
        exec(compile(source, "solution.py", "exec"), namespace)  # noqa: S102
    except BaseException as exc:  # noqa: BLE001
        write(results, (dumps([-1, "error", describe(exc)]) + "\n").encode())
        return
    for index, test in enumerate(tests):
        try:
            if "call" in test:
                value = eval(compile(test["call"], f"test_{index}", "eval"), namespace)
                line = dumps([index, "value", bool(value) if test["as_bool"] else value], allow_nan=False)
            else:
                exec(compile(test["exec"], f"test_{index}", "exec"), dict(namespace))  # noqa: S102
                line = dumps([index, "pass"])
        except BaseException as exc:  # noqa: BLE001
            line = dumps([index, "error", describe(exc)])
        write(results, (line + "\n").encode())


if __name__ == "__main__":
    main()
