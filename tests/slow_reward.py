"""A reward function that takes its time: an operator-registered function used by runtime tests."""

import time


def score(sample, seconds: float = 1.5) -> float:
    time.sleep(seconds)
    return 1.0
