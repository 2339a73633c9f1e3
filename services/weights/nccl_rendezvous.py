"""What the NCCL groups (weight sync: nccl.py, torch's ProcessGroupNCCL, and cupy_nccl.py, cupy's communicator;
the KV group of prefill and decode workers: rollout/pd/kv_group.py) do before they create a communicator, so that forming a group stays within its deadline and fails with a clear error.

NCCL's own initialisation blocks until every rank has called it, with no timeout of its own, and it refuses
two ranks on one GPU with an error that names neither process. So every member first checks in on the
group's store with the GPU it will use (host + GPU UUID, the same for two processes that see one GPU under
different indices): a member that never comes fails the rendezvous as TransferTimeout at the deadline, two
members on one GPU fail as TransferError naming both ranks, before NCCL is touched. Only then is the
communicator created, eagerly (not at the first broadcast), on a thread joined with the same deadline.
"""

import socket
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from services.weights.transfer import TransferError, TransferTimeout

T = TypeVar("T")
_POLL_S = 0.01


def gpu_identity(device: torch.device) -> str:
    """This host's name and the UUID of the GPU behind `device`."""
    return f"{socket.gethostname()}/GPU-{torch.cuda.get_device_properties(device).uuid}"


def check_in(store: dist.Store, group: str, rank: int, world_size: int, identity: str, deadline: float) -> None:
    """Record member `rank`'s GPU `identity` on the group's store and wait (until `deadline`) for every member.

    TransferTimeout when some member has not checked in by the deadline; TransferError when another member
    uses the same GPU (NCCL needs one GPU per member)."""
    store.set(f"gpu/{rank}", identity)
    arrived = store.add("checked-in", 1)
    while arrived < world_size:
        if time.monotonic() > deadline:
            raise TransferTimeout(f"group {group}: {arrived} of {world_size} members checked in before the deadline")
        time.sleep(_POLL_S)
        arrived = store.add("checked-in", 0)
    for other in range(world_size):
        if other != rank and store.get(f"gpu/{other}").decode() == identity:
            raise TransferError(f"group {group}: ranks {min(rank, other)} and {max(rank, other)} are both on GPU "
                                f"{identity}; NCCL needs one GPU per member (give each process a device of its own, "
                                "or use backend 'gloo')")


def within(deadline: float, what: str, step: Callable[[], T]) -> T:
    """`step()` run on a daemon thread; its result, TransferError if it raised, TransferTimeout once `deadline`
    passes (the thread is left behind: a blocked NCCL initialisation cannot be interrupted)."""
    outcome: dict[str, object] = {}

    def run() -> None:
        try:
            outcome["value"] = step()
        except Exception as exc:  # noqa: BLE001 - re-raised in the caller's thread below
            outcome["error"] = exc

    thread = threading.Thread(target=run, name=what, daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0))
    if thread.is_alive():
        raise TransferTimeout(f"{what}: not done by the deadline")
    if "error" in outcome:
        error = outcome["error"]
        raise TransferError(f"{what} failed: {error}") from error
    return outcome["value"]  # type: ignore[return-value]
