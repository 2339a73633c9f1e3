"""Math answer equivalence through math-verify."""

import numpy as np
import pytest

from protos.sample import Sample
from reward.math import math_verify


def text_sample(response: str, **metadata) -> Sample:
    empty = np.zeros(0)
    return Sample("s0", "p0", empty.astype("int32"), empty.astype("int32"), empty.astype("uint8"),
                  empty.astype("float32"), empty.astype("int64"), response_text=response, metadata=metadata)


@pytest.mark.parametrize("response, answer, expected", [
    ("So the result is \\boxed{0.5}.", "\\frac{1}{2}", 1.0),
    ("The answer is $\\frac{1}{2}$", "1/2", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),  # symbolic equality, not string equality
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}", 1.0),
    ("I get 41", "42", 0.0),
    ("no idea", "42", 0.0),
    ("\\boxed{3}", ["2", "3"], 1.0),
])
def test_math_verify(response, answer, expected):
    out = math_verify(text_sample(response, answer=answer))
    assert out.score == expected and out.details["correct"] == expected


def test_unparseable_reference_is_an_error():
    with pytest.raises(ValueError, match="does not parse as math"):
        math_verify(text_sample("\\boxed{1}", answer="\\\\"))
    with pytest.raises(ValueError, match="is missing"):
        math_verify(text_sample("\\boxed{1}"))
