"""code_exec: the response's code against the task's tests, in the sandbox; score = fraction passed."""

import numpy as np
import pytest

from protos.sample import Sample
from reward.code import code_exec, extract_code

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
FAST = {"timeout_s": 30.0, "cpu_s": 2}  # generous wall clock: a loaded machine must not fail a correct answer


def code_sample(response: str, tests) -> Sample:
    empty = np.zeros(0)
    return Sample("s0", "p0", empty.astype("int32"), empty.astype("int32"), empty.astype("uint8"),
                  empty.astype("float32"), empty.astype("int64"), response_text=response, metadata={"tests": tests})


def test_extract_code():
    text = "Idea.\n```python\nx = 1\n```\nBetter:\n```py\ndef f():\n    return 2\n```\n```text\nnot code\n```"
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("x = 1") == "x = 1"
    assert extract_code("```\ny = 2\n```") == "y = 2\n"
    assert extract_code("```python\nz\n```", "none") == "```python\nz\n```"


@pytest.mark.parametrize("response, expected", [
    ("Sure:\n```python\ndef add(a, b):\n    return a + b\n```", 1.0),
    ("def add(a, b):\n    return a + b if a != 2 else 0", 2 / 3),
    ("def add(a, b):\n    return a - b - 1", 0.0),
    ("def add(a, b) return", 0.0),  # syntax error
])
def test_assert_tests_fraction(response, expected):
    out = code_exec(code_sample(response, ADD_TESTS), **FAST)
    assert out.score == pytest.approx(expected)
    assert out.details["total"] == 3.0 and out.details["pass_rate"] == pytest.approx(expected)


def test_failure_reason_names_the_first_failing_test():
    out = code_exec(code_sample("def add(a, b):\n    return 0", ["assert add(0, 0) == 0", "assert add(1, 1) == 2, 'sum'"]),
                    **FAST)
    assert out.score == 0.5 and out.note == "1/2 tests passed; test 1: AssertionError: sum"


def test_exits_and_forged_results_do_not_pass():
    # Results written straight to every open descriptor (the harness's channel among them), without the nonce.
    forged = ("import os\nfor fd in range(3, 64):\n    for i in range(3):\n        try:\n"
              "            os.write(fd, b'[\"0\", \"pass\", %d, \"\"]\\n' % i)\n"
              "        except OSError:\n            pass\nos._exit(0)")
    for cheat in ("import os\nos._exit(0)", "import sys\nsys.exit(0)", "raise SystemExit", forged):
        out = code_exec(code_sample(cheat, ADD_TESTS), **FAST)
        assert out.score == 0.0, cheat


def test_tests_that_pass_before_a_hang_still_count():
    response = "def add(a, b):\n    if a == 2:\n        while True: pass\n    return a + b"
    out = code_exec(code_sample(response, ADD_TESTS), timeout_s=30.0, cpu_s=1)
    assert out.score == pytest.approx(2 / 3)
    assert "killed by SIGXCPU" in out.note


def test_stdin_stdout_tests():
    cases = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10"},
             {"input": "0 0", "output": "1"}]
    out = code_exec(code_sample("a, b = map(int, input().split())\nprint(a + b)", cases), **FAST)
    assert out.score == pytest.approx(2 / 3)
    assert "case 2: wrong output '0'" in out.note


def test_bad_tests_metadata_is_an_error():
    no_tests = code_sample("x = 1", [])
    no_tests.metadata = {}
    with pytest.raises(ValueError, match="no tests to run"):
        code_exec(no_tests)
    with pytest.raises(ValueError, match="must be a string, a list of strings"):
        code_exec(code_sample("x = 1", [1, 2]))
    with pytest.raises(ValueError, match="memory_mb"):
        code_exec(code_sample("x = 1", ["assert True"]), memory_mb=10**9)
