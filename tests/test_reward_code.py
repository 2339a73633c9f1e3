"""code_exec: the response's code against the task's tests, in the sandbox; score = fraction passed."""

import numpy as np
import pytest

from protos.sample import Sample
from reward.code import code_exec, extract_code
from reward.code_tests import CallTest, assert_to_call

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
    # The judge compares the value outside the solution's process, so the note says what came back
    # (it said "AssertionError: sum" when the assert ran next to the solution).
    out = code_exec(code_sample("def add(a, b):\n    return 0", ["assert add(0, 0) == 0", "assert add(1, 1) == 2, 'sum'"]),
                    **FAST)
    assert out.score == 0.5 and out.note == "1/2 tests passed; test 1: add(1, 1) returned 0, expected 2"


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


# Forgeries: each is the whole response; against ADD_TESTS (expected 3, 0, 4) an honest `return 0`
# passes one test, so every score above what the code honestly earns is a forgery that worked.
FRAME_FORGERY = """
import json, os, sys
frame = sys._getframe(1)
while frame is not None:
    seen = frame.f_locals
    if "report" in seen and "spec" in seen:  # the old harness: report every test as passed
        for index in range(len(seen["spec"]["tests"])):
            seen["report"]("pass", index)
    for name in ("results", "channel"):
        if isinstance(seen.get(name), int):
            for index in range(3):
                os.write(seen[name], (json.dumps([index, "pass"]) + "\\n").encode())
                os.write(seen[name], (json.dumps([index, "value", True]) + "\\n").encode())
    frame = frame.f_back
os._exit(0)
"""
GC_FORGERY = """
import gc, json, os
nonce = next((o["nonce"] for o in gc.get_objects() if isinstance(o, dict) and isinstance(o.get("nonce"), str)), "")
for fd in range(1, 64):
    for index in range(3):
        for line in ([nonce, "pass", index, ""], [index, "pass"], [index, "value", True]):
            try:
                os.write(fd, (json.dumps(line) + "\\n").encode())
            except OSError:
                pass
os._exit(0)
"""
ALWAYS_EQUAL = """
class AlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def add(a, b):
    return AlwaysEqual()
"""
ALWAYS_EQUAL_INT = """
class Seven(int):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = int.__hash__
def add(a, b):
    return Seven(7)
"""
PATCHED_BUILTINS = """
import builtins, json
def rewrite(record):
    if isinstance(record, list) and len(record) == 4:  # the old harness's [nonce, kind, index, text]
        return [record[0], "pass", record[2], ""]
    if isinstance(record, list) and len(record) == 3:
        return [record[0], "value", True]
    return record
real_dumps, real_encode = json.dumps, json.JSONEncoder.encode
json.dumps = lambda record, *args, **kwargs: real_dumps(rewrite(record), *args, **kwargs)
json.JSONEncoder.encode = lambda self, record: real_encode(self, rewrite(record))
builtins.print = lambda *args, **kwargs: None
builtins.AssertionError = type("AssertionError", (Exception,), {})
builtins.eval = lambda *args, **kwargs: True
def add(a, b):
    return 0
"""
FAKE_RESULT_LINES = """
import json, os, sys
lines = [json.dumps(line) for index in range(3) for line in ([index, "pass"], [index, "value", "pass"], ["0", "pass", index, ""])]
print("\\n".join(lines))
sys.__stdout__.write("\\n".join(lines) + "\\n")
sys.__stdout__.flush()
for fd in range(1, 16):
    try:
        os.write(fd, ("\\n".join(lines) + "\\n").encode())
    except OSError:
        pass
def add(a, b):
    return 0
"""
# Looks for the expected values anywhere it can reach (frames, objects, files) and returns what it finds.
SNOOPER = """
import gc, os, re, sys
seen = [repr(o)[:10000] for o in gc.get_objects() if isinstance(o, (dict, list, str))]
seen += [open(name).read() for name in os.listdir(".") if os.path.isfile(name)]
frame = sys._getframe()
while frame is not None:
    seen.append(repr(frame.f_locals)[:10000])
    frame = frame.f_back
found = re.findall(r"98765432\\d", "\\n".join(seen))
def add(a, b):
    return int(found[0]) if found else 0
"""


@pytest.mark.parametrize("name, response, honest", [
    ("frame locals of the harness", FRAME_FORGERY, 0.0),
    ("nonce from gc, lines to every fd", GC_FORGERY, 0.0),
    ("__eq__ always true", ALWAYS_EQUAL, 0.0),
    ("int subclass whose __eq__ is always true", ALWAYS_EQUAL_INT, 0.0),
    ("json, print, eval and AssertionError patched", PATCHED_BUILTINS, 1 / 3),
    ("fake result lines on stdout and every fd", FAKE_RESULT_LINES, 1 / 3),
    ("os._exit(0) before the tests", "import os\nos._exit(0)\ndef add(a, b):\n    return a + b", 0.0),
    ("os._exit(0) after two tests", "import os\ndef add(a, b):\n    if a == 2:\n        os._exit(0)\n    return a + b",
     2 / 3),
])
def test_forgeries_score_only_what_the_code_honestly_passes(name, response, honest):
    out = code_exec(code_sample(response, ADD_TESTS), **FAST)
    assert out.score <= honest + 1e-9, f"{name}: {out.note}"


@pytest.mark.parametrize("tests", [
    ["assert add(1, 2) == 987654321"],
    [{"call": "add(1, 2)", "expected": 987654321}],
])
def test_expected_values_never_enter_the_sandbox(tests):
    out = code_exec(code_sample(SNOOPER, tests), **FAST)
    assert out.score == 0.0 and "returned 0, expected 987654321" in out.note, out.note


@pytest.mark.parametrize("text, call, expected, as_bool, strict", [
    ("assert add(1, 2) == 3", "add(1, 2)", 3, False, False),
    ("assert 3 == add(1, 2), 'sum'", "add(1, 2)", 3, False, False),
    ("assert f(-1) == (1, [2.5, None], {'a': -1})", "f(-1)", [1, [2.5, None], {"a": -1}], False, False),
    ("assert x == 1", "x", 1, False, False),
    ("assert Solution().two_sum([2, 7], 9)[0] == 0", "Solution().two_sum([2, 7], 9)[0]", 0, False, False),
    ("assert find(3) is None", "find(3)", None, False, True),
    ("assert is_even(2)", "is_even(2)", True, True, True),
    ("assert not is_even(3)", "is_even(3)", False, True, True),
    ("assert True", "True", True, True, True),
])
def test_asserts_that_convert_into_judged_calls(text, call, expected, as_bool, strict):
    assert assert_to_call(text) == CallTest(call, expected, as_bool=as_bool, strict=strict)


@pytest.mark.parametrize("text", [
    "assert abs(f(1) - 0.5) < 1e-9",  # the comparison would run in the sandbox
    "assert sorted(f(1)) == [1, 2]",  # a builtin computes the compared value
    "assert math.isclose(f(1), 0.5)",
    "assert f(1) != 2",
    "assert f(1) == g(1)",
    "assert f(1) == {1, 2}",  # a set is not JSON
    "x = f(1)\nassert x == 2",
    "assert f(1) is 2",
    "print(1)",
    "assert (",
])
def test_asserts_the_judge_cannot_decide_are_refused_unless_in_process(text):
    assert assert_to_call(text) is None
    with pytest.raises(ValueError, match="assert_mode='in_process'"):
        code_exec(code_sample("def f(x):\n    return x", [text]))


def test_in_process_mode_runs_what_cannot_be_converted_and_says_so():
    tests = ["assert add(1, 2) == 3", "assert abs(add(0.25, 0.25) - 0.5) < 1e-9", "assert sorted([add(1, 1), 0]) == [0, 2]"]
    honest = code_exec(code_sample("def add(a, b):\n    return a + b", tests), assert_mode="in_process", **FAST)
    assert honest.score == 1.0 and honest.details["in_process_tests"] == 2.0
    # The weak mode is weak: an object that answers every comparison passes the in-process tests
    # (not the judged one).
    forged = code_exec(code_sample(ALWAYS_EQUAL.replace("__eq__", "__lt__") + "AlwaysEqual.__eq__ = lambda s, o: True\n"
                                   "AlwaysEqual.__sub__ = lambda s, o: s\nAlwaysEqual.__abs__ = lambda s: s\n"
                                   "AlwaysEqual.__gt__ = lambda s, o: True\n", tests), assert_mode="in_process", **FAST)
    assert forged.score == pytest.approx(2 / 3) and "test 0: TypeError" in forged.note, forged.note
    with pytest.raises(ValueError, match="assert_mode must be"):
        code_exec(code_sample("x = 1", ["assert x == 1"]), assert_mode="trusting")


def test_call_tests_compare_plain_values():
    code = ("def add(a, b):\n    return a + b\ndef pair(a):\n    return (a, [a])\ndef nothing():\n    return None\n"
            "def several():\n    return {1, 2}\ndef noisy():\n    print('[0, \"value\", 3]')\n    return 'quiet'\n")
    tests = [{"call": "add(2, 3)", "expected": 5}, {"call": "pair(1)", "expected": [1, [1]]},
             {"call": "add(0.5, 0.25)", "expected": 0.75}, {"call": "nothing()", "expected": None},
             {"call": "noisy()", "expected": "quiet"}, "assert add('a', 'b') == 'ab'",
             {"call": "several()", "expected": [1, 2]}, {"call": "add(2, 2)", "expected": 5}]
    out = code_exec(code_sample(code, tests), **FAST)
    assert out.details["passed"] == 6.0 and out.details["total"] == 8.0
    assert "test 6: TypeError: Object of type set is not JSON serializable" in out.note, out.note
    with pytest.raises(ValueError, match="'expected' is not JSON data"):
        code_exec(code_sample(code, [{"call": "several()", "expected": {1, 2}}]))
    with pytest.raises(ValueError, match="a call test is"):
        code_exec(code_sample(code, [{"call": "add(1, 2)"}]))


def test_bool_and_identity_tests_want_the_type():
    code = "def is_even(n):\n    return 1 if n % 2 == 0 else []\ndef find(n):\n    return 0\n"
    tests = ["assert is_even(2)", "assert not is_even(3)", "assert find(1) is None", "assert find(1) == False"]
    out = code_exec(code_sample(code, tests), **FAST)
    # bool() of the values is taken in the sandbox; `is None` wants None, not a falsy 0; == False takes 0.
    assert out.details["passed"] == 3.0 and "test 2: find(1) returned 0, expected null" in out.note, out.note


def test_a_solution_that_raises_fails_every_test_with_its_error():
    out = code_exec(code_sample("raise RuntimeError('no')\ndef add(a, b):\n    return a + b", ADD_TESTS), **FAST)
    assert out.score == 0.0 and out.note == "0/3 tests passed; solution raised RuntimeError: no"
