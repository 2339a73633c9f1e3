"""A code task's tests as the judge holds them: what crosses into the sandbox, and what never does.

From `sample.metadata[tests_key]`:
- stdin/stdout tests, a list of {"input": str, "output": str} (IoTest): the solution runs with
  `input` on stdin; the judge compares its stdout with `output`, which never enters the sandbox.
- call tests, {"call": "add(2, 3)", "expected": 5} (CallTest): the harness in the sandbox evaluates
  the expression in the solution's namespace and prints json.dumps of its value; the judge parses
  that (plain data only: a value JSON cannot carry fails) and compares it with `expected`, which
  never enters the sandbox.
- assert tests, strings, converted here into call tests when they have a shape the judge can decide:
  `assert EXPR == LITERAL` (either side), `assert EXPR is None|True|False`, where EXPR is rooted at
  a name the solution defines (`add(1, 2)`, `x`, `Solution().f(3)[0]`, not a builtin such as
  `abs(...)` or `sorted(...)`: the sandbox would compute that part of the check); and `assert NAME(...)`,
  `assert not NAME(...)`, `assert LITERAL` (the sandbox sends bool() of the value). Any other assert
  ("assert abs(f(1) - 0.5) < 1e-9") cannot be judged outside the solution's process: with
  assert_mode "judge" (the default) it is an error; with "in_process" it runs as an InProcessTest,
  judged by the harness inside the sandbox, which the solution can forge (the weak mode).
Values are compared as plain data with Python's ==, after a JSON round trip on both sides: tuples
equal lists, dict keys are strings, `1 == 1.0 == True`; `is` tests and bool tests want the same type.
"""

import ast
import builtins
import json
from dataclasses import dataclass
from typing import Any, Literal

AssertMode = Literal["judge", "in_process"]
_BUILTIN_NAMES = frozenset(dir(builtins))


@dataclass(frozen=True)
class IoTest:
    input: str
    output: str


@dataclass(frozen=True)
class CallTest:
    call: str  # an expression, evaluated in the sandbox
    expected: Any  # JSON data; stays with the judge
    as_bool: bool = False  # the sandbox sends bool(value)
    strict: bool = False  # the same type as well as ==: `is None`, `is True`, bool tests


@dataclass(frozen=True)
class InProcessTest:
    code: str  # run after the solution, in its process; passes when it raises nothing (forgeable)


Test = CallTest | InProcessTest


def plain(value: Any) -> Any:
    """`value` as JSON carries it; ValueError when it cannot."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON data ({exc})") from None


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, plain(ast.literal_eval(node))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return False, None


def _defined_by_solution(node: ast.expr) -> bool:
    """Whether the expression's value comes from a name the solution defines (not a builtin)."""
    while isinstance(node, (ast.Call, ast.Attribute, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return isinstance(node, ast.Name) and node.id not in _BUILTIN_NAMES


def assert_to_call(text: str) -> CallTest | None:
    """The call test an assert statement amounts to, or None when the judge cannot decide it."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        return None
    test = tree.body[0].test
    if isinstance(test, ast.Compare):
        if len(test.ops) != 1:
            return None
        op, sides = test.ops[0], (test.left, test.comparators[0])
        for value_side, literal_side in (sides, sides[::-1]):
            is_literal, expected = _literal(literal_side)
            if not (is_literal and _defined_by_solution(value_side)):
                continue
            if isinstance(op, ast.Eq):
                return CallTest(ast.unparse(value_side), expected)
            singleton = isinstance(literal_side, ast.Constant) and (expected is None or isinstance(expected, bool))
            if isinstance(op, ast.Is) and singleton:
                return CallTest(ast.unparse(value_side), expected, strict=True)
        return None
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    inner = test.operand if negated else test
    is_literal = _literal(inner)[0]
    own_call = isinstance(inner, ast.Call) and _defined_by_solution(inner) and isinstance(inner.func, ast.Name)
    if own_call or is_literal:
        return CallTest(ast.unparse(inner), not negated, as_bool=True, strict=True)
    return None


def _call_test(index: int, entry: dict) -> CallTest:
    if set(entry) != {"call", "expected"} or not isinstance(entry["call"], str):
        raise ValueError(f"test {index}: a call test is {{'call': str, 'expected': JSON value}}, got keys {sorted(entry)}")
    try:
        return CallTest(entry["call"], plain(entry["expected"]))
    except ValueError as exc:
        raise ValueError(f"test {index}: 'expected' is {exc}") from None


def _assert_test(index: int, text: str, assert_mode: AssertMode) -> Test:
    converted = assert_to_call(text)
    if converted is not None:
        return converted
    if assert_mode == "in_process":
        return InProcessTest(text)
    raise ValueError(
        f"test {index} ({text[:80]!r}) cannot be judged outside the solution's process: write it as "
        "`assert EXPR == LITERAL`, `assert EXPR is None`, `assert f(...)` or {'call': ..., 'expected': ...}, "
        "or pass assert_mode='in_process' (weaker: the solution can forge such tests)")


def parse_tests(value: Any, key: str, assert_mode: AssertMode) -> list[IoTest] | list[Test]:
    """The tests in metadata[key]: all stdin/stdout tests, or call tests and asserts (mixed freely)."""
    if assert_mode not in ("judge", "in_process"):
        raise ValueError(f"assert_mode must be 'judge' or 'in_process', got {assert_mode!r}")
    entries = [value] if isinstance(value, str) else value
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"metadata[{key!r}] must be a string or a non-empty list of tests")
    io = [isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str)
          for t in entries]
    if all(io):
        return [IoTest(t["input"], t["output"]) for t in entries]
    tests: list[Test] = []
    for index, entry in enumerate(entries):
        if isinstance(entry, str):
            tests.append(_assert_test(index, entry, assert_mode))
        elif isinstance(entry, dict) and not io[index]:
            tests.append(_call_test(index, entry))
        else:
            raise ValueError(f"metadata[{key!r}] must be a string, a list of strings and "
                             "{'call': str, 'expected': value}, or a list of {'input': str, 'output': str}")
    return tests


def same_value(got: Any, test: CallTest) -> bool:
    """Whether the plain value the sandbox sent passes `test`."""
    if test.strict and type(got) is not type(test.expected):
        return False
    return got == test.expected
