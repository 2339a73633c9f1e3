"""The KV channel over torch.distributed: prefill and decode workers that share a process group move a
transfer's payload by point-to-point send/recv instead of gRPC payload chunks.

    decode --Prefill(kv_group_rank=r, kv_group_tag=t)--> prefill worker
           <--header (payload_from_rank=p)------------  (gRPC: the header alone, checks as ever)
           <==payload bytes: send(dst=r, tag=t)========  (the group: gloo on CPU, or NCCL between GPUs)

The header still carries the payload's length (and its CRC-32 when the payload is on the host), so the decode
worker checks what the group delivered as it checks gRPC chunks (rollout/pd/transfer.py). Each worker joins the group on a
background thread when it starts: a prefill worker must answer health checks before its decode workers
exist, and until the group is up (or if it never comes up) transfers go over gRPC as before.

The group is its own ProcessGroup on a TCP store (rank 0 hosts the store), apart from the weight-sync
groups; every send and recv times out after `timeout_s`. The payload is a uint8 tensor (the encoded KV,
rollout/pd/transfer.py's encode_payload), sent as it is when it is on the group's device. With `backend: gloo`
(the default) it goes as host memory over TCP, and its CRC-32 is checked. With `backend: nccl`, for workers whose
engines are on GPUs, each worker's group lives on its engine's CUDA device (named explicitly, never the thread's
current one): the prefill worker encodes the KV on its GPU and sends that buffer, the decode worker receives it into
a buffer on its GPU and decodes it there; the payload never touches the host (no CRC-32: checksum 0). NCCL ignores tags,
so a decode worker keeps one grouped transfer in flight per prefill worker (rollout/pd/decode.py), and the
members check in with their GPUs first (services/weights/nccl_rendezvous.py: two workers on one GPU are refused
by name). A failed or timed-out NCCL send or recv leaves the group unusable: it is dropped and transfers go over
gRPC again.
"""

import datetime
import logging
import threading
import time
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field

from services.config import Strict
from services.device import transfer_backend
from services.weights.gloo import device_for
from services.weights.nccl_rendezvous import check_in, gpu_identity, within
from services.weights.transfer import TransferError

log = logging.getLogger(__name__)
_POLL_S = 0.0005


class KVGroupConfig(Strict):
    """One worker's place in the group of prefill and decode workers that move KV by send/recv."""

    master: str = Field(description="host:port of the group's TCP store; the worker of rank 0 hosts it.")
    world_size: int = Field(ge=2, description="Workers in the group (prefill and decode).")
    rank: int = Field(ge=0, description="This worker's rank in the group.")
    timeout_s: float = Field(60.0, gt=0, description="Joining the group, and each send or recv.")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "gloo", description="gloo: host bytes over TCP; nccl: between workers whose engines are on GPUs (each its own "
        "GPU), the payload through the engine's CUDA device; auto: the one for the engine's device "
        "(services/device.py transfer_backend: nccl on CUDA, gloo elsewhere).")


class KVGroupError(RuntimeError):
    """A send or recv over the group failed or timed out."""


class KVGroup:
    """A gloo or NCCL group joined in the background; `ready` once every member has joined. `device`: the
    worker's engine device, which an NCCL group lives on (a CUDA device with its index)."""

    def __init__(self, config: KVGroupConfig, device: torch.device | None = None):
        if config.rank >= config.world_size:
            raise ValueError(f"kv_group.rank {config.rank} is outside world_size {config.world_size}")
        self.config = config
        self.rank = config.rank
        self.device = torch.device("cpu")
        self.backend = transfer_backend(device or "cpu") if config.backend == "auto" else config.backend
        if self.backend == "nccl":
            if device is None or device.type != "cuda" or device.index is None:
                raise ValueError(f"kv_group.backend 'nccl' moves KV between GPUs: this worker's engine is on {device}, "
                                 "not a CUDA device (cuda:N); use backend 'gloo'")
            self.device = device
        self._pg: dist.ProcessGroupGloo | dist.ProcessGroupNCCL | None = None
        self._store: dist.TCPStore | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._join, name="kv-group-join", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    @property
    def one_at_a_time(self) -> bool:
        """Transfers between two members must be posted in the same order on both sides (NCCL ignores tags)."""
        return self.backend == "nccl"

    def wait_ready(self, timeout: float | None = None) -> bool:
        return self._ready.wait(timeout)

    def _join(self) -> None:
        host, _, port = self.config.master.rpartition(":")
        timeout = datetime.timedelta(seconds=self.config.timeout_s)
        try:
            store = dist.TCPStore(host, int(port), self.config.world_size, is_master=self.rank == 0, timeout=timeout)
            self._store = store  # rank 0 serves it: kept while the other members may still read it, joined or not
            scoped = dist.PrefixStore("relayrl-kv", store)
            self._pg = self._nccl(scoped) if self.backend == "nccl" else self._gloo(scoped, host)
        except (RuntimeError, dist.DistStoreError, TransferError) as exc:
            log.warning("KV group at %s: rank %d could not join (%s); KV goes over gRPC", self.config.master,
                        self.rank, exc)
            return
        log.info("KV group at %s: rank %d of %d joined (%s on %s)", self.config.master, self.rank,
                 self.config.world_size, self.backend, self.device)
        self._ready.set()

    def _gloo(self, store: dist.Store, host: str) -> dist.ProcessGroupGloo:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = datetime.timedelta(seconds=self.config.timeout_s)
        options._devices = [device_for(host, self.rank)]
        return dist.ProcessGroupGloo(store, self.rank, self.config.world_size, options)

    def _nccl(self, store: dist.Store) -> "dist.ProcessGroupNCCL":
        """Every member checks in with its GPU, then the communicator is made on this worker's device."""
        deadline = time.monotonic() + self.config.timeout_s
        check_in(store, "kv", self.rank, self.config.world_size, gpu_identity(self.device), deadline)
        options = dist.ProcessGroupNCCL.Options()
        # torch's watchdog ends the process when an op outlives this: twice ours, so that _wait's fires first.
        options._timeout = datetime.timedelta(seconds=2 * self.config.timeout_s)
        pg = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), self.rank, self.config.world_size, options)
        pg._set_sequence_number_for_group()
        within(deadline, f"KV group rank {self.rank}: NCCL communicator on {self.device}",
               lambda: pg.eager_connect_single_device(self.device))
        return pg

    def send(self, payload: torch.Tensor, dst: int, tag: int) -> None:
        """Send `payload` (uint8, 1-D; in place when it is on the group's device, else copied there) to rank `dst`
        under `tag`; blocks until it is delivered (run it off the event loop)."""
        tensor = payload.to(self.device)
        self._wait(lambda: self._group().send([tensor], dst, tag), f"send of {tensor.numel()} bytes to rank {dst}")

    def recv(self, nbytes: int, src: int, tag: int) -> torch.Tensor:
        """Receive `nbytes` from rank `src` under `tag` into a uint8 tensor on the group's device, returned; blocks
        (run it off the event loop)."""
        tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._wait(lambda: self._group().recv([tensor], src, tag), f"recv of {nbytes} bytes from rank {src}")
        return tensor

    def _group(self) -> "dist.ProcessGroupGloo | dist.ProcessGroupNCCL":
        if self._pg is None:
            raise KVGroupError("the KV group is not joined")
        return self._pg

    def _wait(self, start, what: str) -> None:
        try:
            work = start()
            if self.backend == "gloo":
                work.wait(datetime.timedelta(seconds=self.config.timeout_s))
                return
            # NCCL's wait() only orders CUDA streams: completion is polled so the timeout holds on the host.
            deadline = time.monotonic() + self.config.timeout_s
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not done after {self.config.timeout_s}s")
                time.sleep(_POLL_S)
            work.wait()  # raises the work's error, if it failed
        except (RuntimeError, TimeoutError) as exc:
            if self.backend == "nccl":
                self._drop()
            raise KVGroupError(f"KV group {what}: {exc}") from exc

    def _drop(self) -> None:
        """An NCCL send or recv that failed or timed out leaves its peers out of step: abort the group, go on
        over gRPC."""
        self._ready.clear()
        pg, self._pg = self._pg, None
        if pg is not None:
            threading.Thread(target=pg.abort, name="kv-group-abort", daemon=True).start()
