"""services/teardown.py: a signal that arrives while a run stops its processes waits until they are all stopped."""

import signal

from services.teardown import signals_deferred


def test_a_signal_within_the_block_is_handled_once_after_it():
    handled: list[str] = []
    previous = signal.signal(signal.SIGUSR1, lambda number, frame: handled.append("handler"))
    try:
        with signals_deferred(signal.SIGUSR1):
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR1)
            handled.append("teardown finished")
        assert handled == ["teardown finished", "handler"]
        signal.raise_signal(signal.SIGUSR1)  # the handler is back
        assert handled[-1] == "handler" and len(handled) == 3
    finally:
        signal.signal(signal.SIGUSR1, previous)
