"""A process's exit without the interpreter's last full garbage collection, and teardowns a signal cannot cut short.

At exit CPython collects every object still alive; after torch, transformers and grpc are imported that is
hundreds of thousands, and on a loaded 2-core machine it took 2-5 s per process after the work was done, which
Ctrl-C of `relayrl run` waited for in the job and in each process it stopped. Objects frozen by gc.freeze() are
left out of every collection, that one included; the memory goes back to the system with the process anyway.
"""

import contextlib
import gc
import signal
import threading


def skip_final_collection() -> None:
    """Call as the process is about to exit (in the entry point's finally)."""
    gc.freeze()


@contextlib.contextmanager
def signals_deferred(*signums: int):
    """Within the block, the Python handlers of `signums` (SIGTERM: `relayrl run` raises SystemExit) wait: a signal
    that arrives while a run stops its processes would cut the stop short and leave the rest running. Each one that
    arrived is raised again after the block. Outside the main thread (which alone runs handlers) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {signum: signal.signal(signum, lambda number, frame: arrived.append(number)) for signum in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)
