"""The KV channel over torch.distributed: prefill and decode workers that share a process group move a
transfer's payload by point-to-point send/recv instead of gRPC payload chunks.

    decode --Prefill(kv_group_rank=r, kv_group_tag=t)--> prefill worker
           <--header (payload_from_rank=p)------------  (gRPC: the header alone, checks as ever)
           <==payload bytes: send(dst=r, tag=t)========  (the group: gloo on CPU, NCCL-capable layout)

The header still carries the payload's length and CRC-32, so the decode worker checks what the group
delivered exactly as it checks gRPC chunks (rollout/kv_transfer.py). Each worker joins the group on a
background thread when it starts: a prefill worker must answer health checks before its decode workers
exist, and until the group is up (or if it never comes up) transfers go over gRPC as before.

The group is its own gloo ProcessGroup on a TCP store (rank 0 hosts the store), apart from the weight-sync
groups; every send and recv times out after `timeout_s`.
"""

import datetime
import logging
import threading

import torch
import torch.distributed as dist
from pydantic import Field

from services.config import Strict
from services.weights.gloo import device_for

log = logging.getLogger(__name__)


class KVGroupConfig(Strict):
    """One worker's place in the group of prefill and decode workers that move KV by send/recv."""

    master: str = Field(description="host:port of the group's TCP store; the worker of rank 0 hosts it.")
    world_size: int = Field(ge=2, description="Workers in the group (prefill and decode).")
    rank: int = Field(ge=0, description="This worker's rank in the group.")
    timeout_s: float = Field(60.0, gt=0, description="Joining the group, and each send or recv.")


class KVGroupError(RuntimeError):
    """A send or recv over the group failed or timed out."""


class KVGroup:
    """A gloo group joined in the background; `ready` once every member has joined."""

    def __init__(self, config: KVGroupConfig):
        if config.rank >= config.world_size:
            raise ValueError(f"kv_group.rank {config.rank} is outside world_size {config.world_size}")
        self.config = config
        self.rank = config.rank
        self._pg: dist.ProcessGroupGloo | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._join, name="kv-group-join", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def _join(self) -> None:
        host, _, port = self.config.master.rpartition(":")
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        try:
            store = dist.TCPStore(host, int(port), self.config.world_size, is_master=self.rank == 0, timeout=timeout)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [device_for(host, self.rank)]
            self._pg = dist.ProcessGroupGloo(dist.PrefixStore("relayrl-kv", store), self.rank,
                                             self.config.world_size, options)
        except (RuntimeError, dist.DistStoreError) as exc:
            log.warning("KV group at %s: rank %d could not join (%s); KV goes over gRPC", self.config.master,
                        self.rank, exc)
            return
        log.info("KV group at %s: rank %d of %d joined", self.config.master, self.rank, self.config.world_size)
        self._ready.set()

    def send(self, payload: bytes, dst: int, tag: int) -> None:
        """Send `payload` to rank `dst` under `tag`; blocks until it is delivered (run it off the event loop)."""
        tensor = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._wait(lambda: self._group().send([tensor], dst, tag), f"send of {len(payload)} bytes to rank {dst}")

    def recv(self, nbytes: int, src: int, tag: int) -> bytes:
        """Receive `nbytes` from rank `src` under `tag`; blocks (run it off the event loop)."""
        tensor = torch.empty(nbytes, dtype=torch.uint8)
        self._wait(lambda: self._group().recv([tensor], src, tag), f"recv of {nbytes} bytes from rank {src}")
        return tensor.numpy().tobytes()

    def _group(self) -> dist.ProcessGroupGloo:
        if self._pg is None:
            raise KVGroupError("the KV group is not joined")
        return self._pg

    def _wait(self, start, what: str) -> None:
        try:
            start().wait(datetime.timedelta(seconds=self.config.timeout_s))
        except RuntimeError as exc:
            raise KVGroupError(f"KV group {what}: {exc}") from exc
