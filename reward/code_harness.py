"""Runs inside the sandbox (standard library only): execute a solution, then each test against it.

Reads spec.json (nonce, tests) from the working directory and deletes it; writes one JSON line
per event, [nonce, kind, index, text], to the file descriptor in $RELAYRL_RESULT_FD. A result
is written as soon as a test finishes, so tests that passed before a later one hangs still
count. The nonce makes results printed by the solution itself (or an early exit) count for nothing.
"""

import json
import os


def main() -> None:
    with open("spec.json") as f:
        spec = json.load(f)
    os.remove("spec.json")
    channel = int(os.environ.pop("RELAYRL_RESULT_FD"))
    nonce = spec["nonce"]

    def report(kind: str, index: int, text: str = "") -> None:
        os.write(channel, (json.dumps([nonce, kind, index, text[:300]]) + "\n").encode())

    with open("solution.py") as f:
        source = f.read()
    namespace = {"__name__": "solution"}
    # Running the untrusted code is the point (inside the sandbox); whatever it raises,
    # SystemExit and MemoryError included, is its result.
    try:
        exec(compile(source, "solution.py", "exec"), namespace)  # noqa: S102
    except BaseException as exc:  # noqa: BLE001
        report("solution_error", -1, f"{type(exc).__name__}: {exc}")
        return
    for index, test in enumerate(spec["tests"]):
        try:
            exec(compile(test, f"test_{index}", "exec"), dict(namespace))  # noqa: S102
        except BaseException as exc:  # noqa: BLE001
            report("fail", index, f"{type(exc).__name__}: {exc}")
        else:
            report("pass", index)
    report("done", len(spec["tests"]))


if __name__ == "__main__":
    main()
