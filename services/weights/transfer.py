"""The data plane of a weight update: a process group that broadcasts buckets from rank 0 (the trainer).

One small interface, one file per backend (gloo.py, nccl.py), chosen by `GroupSpec.backend`.
"""

import datetime
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

Backend = Literal["gloo", "nccl"]
BACKENDS: tuple[str, ...] = ("gloo", "nccl")


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


def backend_device(backend: str) -> torch.device:
    """Where buckets live for `backend`: CPU for gloo, the current CUDA device for NCCL."""
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


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


def make_group(spec: GroupSpec, timeout_s: float, store: dist.Store | None = None) -> Transfer:
    """Form the group described by `spec` (blocks until every member joined, at most `timeout_s`).

    Rank 0 passes the store it hosts (`host_store`); the others connect to it. Each group lives under
    its own `group_name` prefix, so one store serves every group the trainer forms.
    """
    store = store if store is not None else join_store(spec, timeout_s)
    scoped = dist.PrefixStore(f"{spec.group_name}/", store)
    if spec.backend == "gloo":
        from services.weights.gloo import GlooTransfer

        return GlooTransfer(spec, scoped, timeout_s)
    from services.weights.nccl import NcclTransfer

    return NcclTransfer(spec, scoped, timeout_s)
