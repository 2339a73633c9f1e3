"""Math answer equivalence through Hugging Face's `math-verify` (sympy-backed)."""

from math_verify import parse, verify

from protos.sample import Sample
from reward.match import references
from reward.registry import RewardOutput


def _gold(reference: object) -> list:
    """Parse a reference answer; bare LaTeX ("x^2+1") parses reliably only inside $...$."""
    text = str(reference)
    return parse(text if "$" in text or "\\boxed" in text else f"${text}$")


def math_verify(sample: Sample, *, answer_key: str = "answer", float_rounding: int = 6,
                timeout_s: int = 5) -> RewardOutput:
    """1.0 when the response's final answer is mathematically equal to a reference answer.

    The response is parsed the math-verify way (last \\boxed{} first, then LaTeX and plain
    expressions). `timeout_s` bounds each parse/verify call (math-verify uses SIGALRM, so this
    runs in a process's main thread, as the reward workers do).
    """
    golds = [_gold(ref) for ref in references(sample, answer_key)]
    if not any(golds):
        raise ValueError(f"metadata[{answer_key!r}] = {sample.metadata[answer_key]!r} does not parse as math")
    answer = parse(sample.response_text, parsing_timeout=timeout_s)
    correct = float(bool(answer) and any(
        verify(gold, answer, float_rounding=float_rounding, timeout_seconds=timeout_s) for gold in golds if gold
    ))
    note = f"parsed {answer[-1]!r}" if answer else "no answer found"
    return RewardOutput(correct, {"correct": correct}, note=note[:120])
