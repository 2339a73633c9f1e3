"""The data plane of a weight update: a process group that broadcasts buckets from rank 0 (the trainer).

The interface every backend implements (Transfer, Pending), the group's spec, its errors and its rendezvous
store. One file per backend: gloo.py (CPU tensors over TCP), nccl.py (CUDA tensors through torch's
ProcessGroupNCCL), cupy_nccl.py (CUDA tensors through cupy's NCCL bindings, the `gpu` extra), cuda_ipc.py (CUDA
IPC handles, for receivers on the trainer's own GPU); backends.py picks one by `GroupSpec.backend` and by where
the members are. The backends import this module; it imports none of them. The CUDA backends run on the CUDA
device each member names explicitly.
"""

import datetime
import importlib.util
import socket
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from protos import weights_pb2
from protos.codec import CodecError

Backend = Literal["gloo", "nccl", "cupy_nccl", "cuda_ipc"]
BACKENDS: tuple[str, ...] = ("gloo", "nccl", "cupy_nccl", "cuda_ipc")


class TransferError(RuntimeError):
    """A collective of a weight update failed; the group is no longer usable."""


class TransferTimeout(TransferError, TimeoutError):
    """A step of a weight update did not finish before its deadline."""


@dataclass(frozen=True)
class GroupSpec:
    """One member's view of a weight-update group (the wire's TransferGroup)."""

    backend: Backend
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    group_name: str
    existing: bool = False  # formed by an earlier update; members must still hold it

    def to_proto(self) -> weights_pb2.TransferGroup:
        return weights_pb2.TransferGroup(
            backend=self.backend, master_addr=self.master_addr, master_port=self.master_port,
            world_size=self.world_size, rank=self.rank, group_name=self.group_name, existing=self.existing,
        )

    @classmethod
    def from_proto(cls, msg: weights_pb2.TransferGroup) -> "GroupSpec":
        """Validate a TransferGroup from the wire; CodecError names the field."""
        if msg.backend not in BACKENDS:
            raise CodecError(f"group.backend: {msg.backend!r} is not one of {', '.join(BACKENDS)}")
        if not msg.master_addr or not 0 < msg.master_port < 65536:
            raise CodecError(f"group: bad rendezvous address {msg.master_addr!r}:{msg.master_port}")
        if msg.world_size < 2 or not 0 < msg.rank < msg.world_size:
            raise CodecError(f"group: rank {msg.rank} of world {msg.world_size} (receivers are ranks 1..world-1)")
        if not msg.group_name:
            raise CodecError("group.group_name: must be set")
        return cls(msg.backend, msg.master_addr, msg.master_port, msg.world_size, msg.rank, msg.group_name,
                   msg.existing)


def transfer_device(backend: str, device: torch.device | str | None) -> torch.device:
    """Where a member's buckets live for `backend`: the CPU for gloo; for the CUDA backends (NCCL, CUDA IPC)
    `device`, a CUDA device with its index. It is chosen explicitly by each member (the rollout engine's device, the trainer's),
    never taken as the calling thread's current CUDA device (cuda:0 in a gRPC handler thread, whatever GPU the
    engine is on). TransferError says why `device` cannot carry `backend`."""
    if backend == "gloo":
        return torch.device("cpu")
    resolved = None if device is None else torch.device(device)
    if resolved is None or resolved.type != "cuda" or resolved.index is None:
        raise TransferError(f"backend {backend!r} moves CUDA tensors: it needs a CUDA device with its index "
                            f"(cuda:N), not {resolved}; on CPU use backend 'gloo'")
    if backend == "cupy_nccl" and importlib.util.find_spec("cupy") is None:
        raise TransferError("backend 'cupy_nccl' needs cupy: pip install 'relayrl[gpu]' (cupy-cuda12x)")
    return resolved


def deadline_after(seconds: float) -> float:
    return time.monotonic() + seconds


def remaining(deadline: float, what: str) -> float:
    """Seconds left before `deadline`; TransferTimeout naming `what` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout(f"{what}: deadline passed")
    return left


def host_store(bind_host: str, timeout_s: float, port: int = 0) -> dist.TCPStore:
    """The rendezvous store, hosted by rank 0 on `port` (0 = a free one) of `bind_host` only (read it from `.port`).

    TCPStore on its own listens on every interface whatever host it is given; the store gets a socket
    already bound to `bind_host` instead, so a loopback trainer is unreachable from other machines.
    """
    family, _, _, _, address = socket.getaddrinfo(bind_host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(128)
    port = listener.getsockname()[1]
    # The store owns the descriptor from here (detach: the socket object must not close it).
    return dist.TCPStore(bind_host, port, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=listener.detach())


def join_store(spec: GroupSpec, timeout_s: float) -> dist.TCPStore:
    """A client of rank 0's rendezvous store."""
    try:
        return dist.TCPStore(spec.master_addr, spec.master_port, None, False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, dist.DistStoreError) as exc:
        raise TransferTimeout(f"group {spec.group_name}: cannot reach the rendezvous store at "
                              f"{spec.master_addr}:{spec.master_port}: {exc}") from exc


class Pending(ABC):
    """An in-flight broadcast."""

    @abstractmethod
    def wait(self, deadline: float) -> None:
        """Return once the bucket is sent (rank 0) or received; TransferTimeout past `deadline`."""


class Transfer(ABC):
    """A formed group that broadcasts tensors from rank 0 to every member."""

    def __init__(self, spec: GroupSpec):
        self.spec = spec

    @property
    def device(self) -> torch.device:
        """Where bucket tensors must live for this backend."""
        return torch.device("cpu")

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor) -> Pending:
        """Start broadcasting `tensor` from rank 0 into every member's tensor of the same size."""

    @abstractmethod
    def _release(self) -> None:
        """Free the group (may block until stuck collectives time out)."""

    def close(self, wait_s: float = 0.0) -> None:
        """Drop the group, waiting at most `wait_s` for it to be freed: a group with a stuck collective only
        frees itself once that collective's timeout passes, so it is released on a daemon thread. A process
        about to exit waits: a group still being freed when the interpreter finalizes aborts the process."""
        thread = threading.Thread(target=self._release, name=f"release-{self.spec.group_name}", daemon=True)
        thread.start()
        thread.join(wait_s)

