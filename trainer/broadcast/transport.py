"""The process group that carries a publish's tensors: the rendezvous store, the group kept across publishes,
forming it (rank 0: this trainer) and sending on it. What the receivers are told (gRPC) is broadcaster.py's.

A group is kept while its membership is unchanged and every step succeeded: a rendezvous costs ~0.2-0.5 s on
loopback, more than the transfer of a small model. Dropped, the next one forms under a new name.
"""

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from services.weights import BucketSender, GroupSpec, Manifest, Transfer, host_store, make_group, send_tensors
from services.weights.torch_group import make_torch_group
from trainer.broadcast.config import BroadcastConfig
from trainer.broadcast.gather import ShardedWeights

Tensors = Mapping[str, torch.Tensor] | ShardedWeights


@dataclass
class Group:
    """The group of a publish: its members (ranks 1.., in this order) and its name in the rendezvous store."""

    members: tuple[str, ...]
    name: str
    transfer: Transfer | None = None  # None until this process has joined
    # The members take one broadcast per tensor on a torch.distributed named group (their BeginUpdate said so:
    # SGLang receiving itself); False: buckets on this project's own group.
    tensor_broadcasts: bool = False


class Transport:
    """Forms, keeps and sends on the group of each publish. `device`: where buckets are packed and sent from
    (the NCCL backends: this process's CUDA device); None = the published tensors'."""

    def __init__(self, config: BroadcastConfig, device: torch.device | None = None):
        self.config = config
        self.device = device
        self._sender = BucketSender()
        self._token = uuid.uuid4().hex[:8]
        self._groups_planned = 0
        self._group: Group | None = None
        self._store = None

    def group_for(self, members: list[str]) -> Group:
        """The kept group if its members are these, else a new one under a name no store has seen."""
        if self._group is not None and self._group.members == tuple(members):
            return self._group
        self.drop()
        self._groups_planned += 1
        self._group = Group(tuple(members), f"relayrl-wsync-{self._token}-{self._groups_planned}")
        return self._group

    def drop(self, wait_s: float = 0.0) -> None:
        """Leave the kept group, if any; the next publish forms a new one."""
        if self._group is not None and self._group.transfer is not None:
            self._group.transfer.close(wait_s)
        self._group = None

    async def member_specs(self, group: Group) -> list[GroupSpec]:
        """What each member (ranks 1.., in order) is told to join, the rendezvous store started if need be."""
        if self._store is None:
            self._store = await asyncio.to_thread(host_store, self.config.master_addr, self.config.timeout_s,
                                                  self.config.master_port)
        return [self.spec(group, rank) for rank in range(1, len(group.members) + 1)]

    async def join(self, group: Group, tensors: Tensors) -> None:
        """Form the new group as its rank 0 (the rendezvous); raises TransferError."""
        device = self.device if self.device is not None else _device_of(tensors)  # which GPU, for CUDA IPC
        spec, timeout_s = self.spec(group, 0), self.config.timeout_s
        if group.tensor_broadcasts:
            group.transfer = await asyncio.to_thread(make_torch_group, spec, timeout_s, self._store, device)
        else:
            group.transfer = await asyncio.to_thread(make_group, spec, timeout_s, self._store, device,
                                                     self.config.cuda_ipc)

    async def send(self, group: Group, manifest: Manifest, tensors: Tensors, deadline: float) -> None:
        """Broadcast every tensor of `manifest` on the joined group by `deadline`; raises TransferError.

        Sharded weights are gathered bucket by bucket as the buckets go out; members that take one broadcast per
        tensor get them gathered whole first (a copy of the model on the trainer's device)."""
        if group.tensor_broadcasts:
            if isinstance(tensors, ShardedWeights):
                tensors = await asyncio.to_thread(tensors.gathered_copy)
            await asyncio.to_thread(send_tensors, group.transfer, manifest, tensors, deadline)
        else:
            await asyncio.to_thread(self._sender.send, group.transfer, manifest, tensors, deadline)

    async def close(self) -> None:
        await asyncio.to_thread(self.drop, self.config.control_timeout_s)
        self._store = None

    def spec(self, group: Group, rank: int) -> GroupSpec:
        """Rank `rank`'s view of the group (0: this process's), the store started (member_specs)."""
        return GroupSpec(self.config.backend, self.config.master_addr, self._store.port,  # type: ignore[arg-type]
                         len(group.members) + 1, rank, group.name, existing=group.transfer is not None)


def _device_of(tensors: Tensors) -> torch.device:
    return tensors.device if isinstance(tensors, ShardedWeights) else next(iter(tensors.values())).device
