"""String rewards: exact match, numeric match and regex format checks against sample metadata.

The reference answer is `sample.metadata[answer_key]` (default "answer"): a string, a number,
or a list of acceptable answers.
"""

import math
import re
from fractions import Fraction
from typing import Any, Literal

from protos.sample import Sample
from reward.registry import RewardOutput

Extract = Literal["auto", "answer_tag", "boxed", "gsm8k", "last_line", "none"]
_EXTRACT_MODES = Extract.__args__

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_GSM8K = re.compile(r"####\s*(.+)")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i]
        i += 1
    return None


def extract_answer(text: str, how: Extract = "auto") -> str:
    """The part of a response that states the answer.

    auto: the last <answer>...</answer>, else the last \\boxed{...}, else text after "####",
    else the whole response.
    """
    if how not in _EXTRACT_MODES:
        raise ValueError(f"extract must be one of {', '.join(_EXTRACT_MODES)}, got {how!r}")
    if how in ("auto", "answer_tag") and (tags := _ANSWER_TAG.findall(text)):
        return tags[-1]
    if how in ("auto", "boxed") and (boxed := last_boxed(text)) is not None:
        return boxed
    if how in ("auto", "gsm8k") and (marks := _GSM8K.findall(text)):
        return marks[-1]
    if how == "last_line":
        lines = [line for line in text.splitlines() if line.strip()]
        return lines[-1] if lines else ""
    return text if how in ("auto", "none") else ""


def normalize(text: str, case_sensitive: bool = False) -> str:
    """Collapse whitespace, drop surrounding $ and a trailing period; casefold unless case_sensitive."""
    text = " ".join(text.split()).strip("$ ").removesuffix(".").strip()
    return text if case_sensitive else text.casefold()


def references(sample: Sample, key: str) -> list[Any]:
    if key not in sample.metadata:
        raise ValueError(f"metadata[{key!r}] is missing: no reference answer to compare with")
    ref = sample.metadata[key]
    return list(ref) if isinstance(ref, (list, tuple)) else [ref]


def exact_match(
    sample: Sample,
    *,
    answer_key: str = "answer",
    extract: Extract = "auto",
    case_sensitive: bool = False,
) -> RewardOutput:
    """1.0 when the extracted, normalised answer equals a reference answer, else 0.0."""
    got = normalize(extract_answer(sample.response_text, extract), case_sensitive)
    wanted = {normalize(str(ref), case_sensitive) for ref in references(sample, answer_key)}
    correct = float(got in wanted)
    return RewardOutput(correct, {"correct": correct}, note=f"extracted {got[:80]!r}")


def parse_number(text: str) -> float | None:
    """'1,234.5' -> 1234.5, '3/4' -> 0.75, '-2e3' -> -2000.0; None if `text` holds no number."""
    cleaned = text.replace("$", "").replace("%", "").strip()
    candidates = [m.group(0) for m in _NUMBER.finditer(cleaned) if any(c.isdigit() for c in m.group(0))]
    if not candidates:
        return None
    token = candidates[-1].replace(",", "").replace(" ", "")
    if "/" in token:
        num, den = token.split("/")
        if int(den) == 0:
            return None
        return float(Fraction(num) / Fraction(den))
    return float(token)


def numeric_match(
    sample: Sample,
    *,
    answer_key: str = "answer",
    extract: Extract = "auto",
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
) -> RewardOutput:
    """1.0 when the last number of the extracted answer equals a reference number within tolerance."""
    got = parse_number(extract_answer(sample.response_text, extract))
    wanted = [parse_number(str(ref)) for ref in references(sample, answer_key)]
    if any(ref is None for ref in wanted):
        raise ValueError(f"metadata[{answer_key!r}] holds no number: {sample.metadata[answer_key]!r}")
    correct = float(got is not None and any(math.isclose(got, ref, rel_tol=rel_tol, abs_tol=abs_tol)
                                            for ref in wanted))
    return RewardOutput(correct, {"correct": correct}, note=f"parsed {got}")


_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE}


def regex_match(
    sample: Sample,
    *,
    pattern: str | None = None,
    mode: Literal["search", "fullmatch"] = "search",
    flags: str = "",
) -> RewardOutput:
    """1.0 when the response matches `pattern` (or metadata["pattern"]), else 0.0.

    `flags` is a string of i, m, s, x. A format reward: e.g. pattern "<think>.*</think>\\s*<answer>.*</answer>",
    mode "fullmatch", flags "s".
    """
    pattern = pattern if pattern is not None else sample.metadata.get("pattern")
    if pattern is None:
        raise ValueError("regex_match needs a pattern (function_args or metadata['pattern'])")
    if mode not in ("search", "fullmatch"):
        raise ValueError(f"regex_match: mode must be 'search' or 'fullmatch', got {mode!r}")
    unknown = set(flags) - set(_FLAGS)
    if unknown:
        raise ValueError(f"regex_match: unknown flag(s) {''.join(sorted(unknown))} (use i, m, s, x)")
    compiled = re.compile(pattern, sum((_FLAGS[f] for f in set(flags)), 0))
    matcher = compiled.fullmatch if mode == "fullmatch" else compiled.search
    matched = float(matcher(sample.response_text) is not None)
    return RewardOutput(matched, {"format": matched})
