"""String rewards and the registry, called directly (no processes)."""

import numpy as np
import pytest

from protos.sample import Sample
from reward import registry
from reward.match import exact_match, extract_answer, last_boxed, numeric_match, parse_number, regex_match
from reward.registry import BUILTINS, BadFunction, Registry, RewardOutput, RewardSpec, UnknownFunction


def text_sample(response: str, **metadata) -> Sample:
    empty = np.zeros(0)
    return Sample("s0", "p0", empty.astype("int32"), empty.astype("int32"), empty.astype("uint8"),
                  empty.astype("float32"), empty.astype("int64"), response_text=response, metadata=metadata)


@pytest.mark.parametrize("response, answer, expected", [
    ("42", "42", 1.0),
    ("  42. ", "42", 1.0),
    ("The sum is \\boxed{42}", "42", 1.0),
    ("work... #### 42", 42, 1.0),
    ("<answer>Paris</answer>", "paris", 1.0),
    ("<answer>Paris</answer> \\boxed{Rome}", "paris", 1.0),  # the answer tag wins over \boxed
    ("41", "42", 0.0),
    ("The answer is 42", "42", 0.0),  # no marker: the whole response must match
    ("B", ["A", "B"], 1.0),
])
def test_exact_match(response, answer, expected):
    out = exact_match(text_sample(response, answer=answer))
    assert out.score == expected and out.details == {"correct": expected}


def test_exact_match_options():
    assert exact_match(text_sample("Paris", answer="paris"), case_sensitive=True).score == 0.0
    assert exact_match(text_sample("x\n 7 ", answer="7"), extract="last_line").score == 1.0
    assert exact_match(text_sample("7", label="7"), answer_key="label").score == 1.0
    with pytest.raises(ValueError, match=r"metadata\['answer'\] is missing"):
        exact_match(text_sample("7"))
    with pytest.raises(ValueError, match="extract must be one of"):
        exact_match(text_sample("7", answer="7"), extract="weird")


def test_extraction_helpers():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None
    assert extract_answer("x #### 12", "gsm8k") == "12" and extract_answer("no marks", "boxed") == ""


@pytest.mark.parametrize("text, value", [
    ("1,234.5", 1234.5), ("3/4", 0.75), ("-2e3 apples", -2000.0), ("$12", 12.0), ("so 7.", 7.0),
    ("first 1 then 2", 2.0), ("none here", None), ("1/0", None),
])
def test_parse_number(text, value):
    assert parse_number(text) == value


def test_numeric_match():
    assert numeric_match(text_sample("It costs $1,000.", answer="1000")).score == 1.0
    assert numeric_match(text_sample("\\boxed{0.3333333}", answer="1/3"), rel_tol=1e-6).score == 1.0
    assert numeric_match(text_sample("\\boxed{0.33}", answer="1/3")).score == 0.0
    assert numeric_match(text_sample("no number", answer=5)).score == 0.0
    with pytest.raises(ValueError, match="holds no number"):
        numeric_match(text_sample("5", answer="five"))


def test_regex_match():
    think = "<think>\nhmm\n</think> <answer>4</answer>"
    fmt = {"pattern": r"<think>.*</think>\s*<answer>.*</answer>", "mode": "fullmatch", "flags": "s"}
    assert regex_match(text_sample(think), **fmt).score == 1.0
    assert regex_match(text_sample("just 4"), **fmt).score == 0.0
    assert regex_match(text_sample("ABC", pattern="abc"), flags="i").score == 1.0  # pattern from metadata
    with pytest.raises(ValueError, match="needs a pattern"):
        regex_match(text_sample("x"))
    with pytest.raises(ValueError, match="unknown flag"):
        regex_match(text_sample("x"), pattern="x", flags="q")
    with pytest.raises(ValueError, match="mode must be"):
        regex_match(text_sample("x"), pattern="x", mode="match")


def test_registry_resolves_builtins_and_paths():
    reg = Registry(BUILTINS)
    assert {"exact_match", "numeric_match", "regex_match", "math_verify", "code_exec"} <= set(reg.names())
    fn = registry.load(reg.get("exact_match"))
    assert fn is exact_match
    with pytest.raises(UnknownFunction, match="unknown reward function 'nope'"):
        reg.get("nope")
    with pytest.raises(UnknownFunction, match="not allowed"):
        reg.get("reward.match:exact_match")
    assert registry.load(reg.get("reward.match:exact_match", allow_custom=True)) is exact_match
    with pytest.raises(UnknownFunction, match="not a 'package.module:function' path"):
        reg.get("os.system; rm:x", allow_custom=True)
    with pytest.raises(BadFunction, match="cannot import"):
        registry.load(reg.get("no_such_module:fn", allow_custom=True))
    with pytest.raises(BadFunction, match="cannot import"):
        registry.load(reg.get("reward.match:no_such_fn", allow_custom=True))


def response_length(sample: Sample, *, scale: float = 1.0) -> float:
    return scale * len(sample.response_text)


def test_register_and_check_args():
    reg = Registry(BUILTINS)
    reg.register("length")(response_length)
    spec = reg.get("length")
    assert spec.target.endswith("test_reward_match:response_length")
    with pytest.raises(ValueError, match="already registered"):
        reg.add(RewardSpec("length", "x:y"))
    with pytest.raises(ValueError, match="only module-level functions"):
        reg.register("local")(lambda sample: 1.0)
    registry.check_args(spec, response_length, {"scale": 2.0})
    with pytest.raises(BadFunction, match="unexpected keyword argument 'bogus'"):
        registry.check_args(spec, response_length, {"bogus": 1})
    bound = RewardSpec("rm", "reward.model:reward_model", batched=True, bound_args={"path": "/models/rm"})
    assert registry.call_args(bound, {"batch_size": 2}) == {"batch_size": 2, "path": "/models/rm"}
    with pytest.raises(BadFunction, match="fixed by the server"):
        registry.call_args(bound, {"path": "/etc"})


def test_as_output():
    assert registry.as_output(True, "f") == RewardOutput(1.0)
    assert registry.as_output(RewardOutput(0.5, {"a": 1.0}), "f").details == {"a": 1.0}
    with pytest.raises(TypeError, match="expected RewardOutput or float"):
        registry.as_output("1.0", "f")
    with pytest.raises(ValueError, match="not a finite number"):
        registry.as_output(float("nan"), "f")
    with pytest.raises(TypeError, match="details that are not str -> number"):
        registry.as_output(RewardOutput(1.0, {"why": "text"}), "f")
    assert registry.as_output(RewardOutput(1, {"n": 2}, "x" * 5000), "f") == RewardOutput(1.0, {"n": 2.0}, "x" * 1000)
