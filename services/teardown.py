"""A process's exit without the interpreter's last full garbage collection, and teardowns a signal cannot cut short.

At exit CPython collects every object still alive; after torch, transformers and grpc are imported that is
hundreds of thousands, and on a loaded 2-core machine it took 2-5 s per process after the work was done, which
Ctrl-C of `relayrl run` waited for in the job and in each process it stopped. Objects frozen by gc.freeze() are
left out of every collection, that one included; the memory goes back to the system with the process anyway.

Native extensions built with nanobind (triton, which torch imports with torch._dynamo wherever it is installed)
count the objects of theirs still alive at teardown and print each "leaked" one to stderr: with the collection
skipped that is hundreds of lines after a run's last word. Once everything else has run at exit, such a process
closes its stderr first; nothing of the run is written after that point.
"""

import atexit
import contextlib
import gc
import os
import signal
import sys
import threading

_NANOBIND_MODULES = ("triton",)


def skip_final_collection() -> None:
    """Call as the process is about to exit (in the entry point's finally)."""
    gc.freeze()
    if any(name in sys.modules for name in _NANOBIND_MODULES):
        atexit.register(_close_stderr)  # registered last, so it runs first: after the entry point has returned


def _close_stderr() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)


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
