"""What the NCCL groups (weight sync: nccl.py, torch's ProcessGroupNCCL, and cupy_nccl.py, cupy's communicator;
the KV group of prefill and decode workers: rollout/pd/kv_group.py) do before they create a communicator, so that forming a group stays within its deadline and fails with a clear error.

NCCL's own initialisation blocks until every rank has called it, with no timeout of its own, and it refuses
two ranks on one GPU with an error that names neither process. So every member first checks in on the
group's store with the GPU it will use (host + GPU UUID, the same for two processes that see one GPU under
different indices): a member that never comes fails the rendezvous as TransferTimeout at the deadline, two
members on one GPU fail as TransferError naming both ranks, before NCCL is touched. Only then is the
communicator created, eagerly (not at the first broadcast), on a thread joined with the same deadline.

Weight-update groups check in whatever their backend (services/weights/backends.py), each member with the device
it stages on (`device_identity`: a CPU member checks in as its host's CPU): the identities decide whether the group
is one of CUDA IPC handles (every receiver on the trainer's GPU: cuda_ipc.py) before the shared-GPU refusal applies.
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


def device_identity(device: torch.device | str | None) -> str:
    """gpu_identity for a CUDA device; for anything else this host's CPU (`<host>/cpu`, never a GPU's)."""
    device = None if device is None else torch.device(device)
    if device is not None and device.type == "cuda":
        return gpu_identity(device)
    return f"{socket.gethostname()}/cpu"


def check_in(store: dist.Store, group: str, rank: int, world_size: int, identity: str, deadline: float,
             one_gpu_each: bool = True) -> list[str]:
    """Record member `rank`'s GPU `identity` on the group's store, wait (until `deadline`) for every member, and
    return every member's identity, by rank.

    TransferTimeout when some member has not checked in by the deadline; with `one_gpu_each`, TransferError when
    another member uses the same GPU (NCCL needs one GPU per member: see refuse_shared_gpus)."""
    store.set(f"gpu/{rank}", identity)
    arrived = store.add("checked-in", 1)
    while arrived < world_size:
        if time.monotonic() > deadline:
            raise TransferTimeout(f"group {group}: rendezvous: {arrived} of {world_size} members checked in before "
                                  "the deadline")
        time.sleep(_POLL_S)
        arrived = store.add("checked-in", 0)
    identities = [store.get(f"gpu/{other}").decode() for other in range(world_size)]
    if one_gpu_each:
        refuse_shared_gpus(group, rank, identities)
    return identities


def refuse_shared_gpus(group: str, rank: int, identities: list[str]) -> None:
    """TransferError naming both ranks when another member is on member `rank`'s GPU."""
    for other, identity in enumerate(identities):
        if other != rank and identity == identities[rank]:
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
