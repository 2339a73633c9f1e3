"""A process's exit without the interpreter's last full garbage collection.

At exit CPython collects every object still alive; after torch, transformers and grpc are imported that is
hundreds of thousands, and on a loaded 2-core machine it took 2-5 s per process after the work was done, which
Ctrl-C of `relayrl run` waited for in the job and in each process it stopped. Objects frozen by gc.freeze() are
left out of every collection, that one included; the memory goes back to the system with the process anyway.
"""

import gc


def skip_final_collection() -> None:
    """Call as the process is about to exit (in the entry point's finally)."""
    gc.freeze()
