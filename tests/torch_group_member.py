"""A rollout worker's WeightSync service whose engine side receives the way SGLang's scheduler does, and nothing
else: it joins the trainer's group with the torch.distributed calls of SGLang's `init_weights_update_group`
(tcp:// rendezvous on the trainer's store, PrefixStore(group_name), torch's named-group helper) and receives
with those of `update_weights_from_distributed` (one async broadcast per tensor into torch.empty(shape, dtype),
in the order of the names it was given). No model: what arrived is saved to OUT/v<version>.pt at commit, for
tests/test_weight_sync_tensors.py to compare with what the trainer sent. gloo, CPU. It takes the tensors of
LAYOUT, or with MODEL those of that Hugging Face folder in float32.

    python tests/torch_group_member.py PORT_FILE OUT [MODEL]
"""

import asyncio
import datetime
import pathlib
import sys

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from protos import weights_pb2_grpc
from rollout.engines.base import checkpoint_layout
from rollout.serve.weight_receiver import WeightReceiver
from services.config import ServerConfig
from services.runtime import serve
from services.weights import GroupSpec, Manifest

# What the trainer publishes in the test: mixed dtypes and shapes, one tensor larger than the others.
LAYOUT = {"embed.weight": ((64, 16), torch.float32), "layers.0.q_proj.weight": ((16, 16), torch.bfloat16),
          "layers.0.q_proj.bias": ((16,), torch.bfloat16), "layers.0.norm.weight": ((16,), torch.float16),
          "layers.0.k_proj.weight": ((4, 16), torch.float32), "lm_head.weight": ((64, 16), torch.float32)}
_TIMEOUT = datetime.timedelta(seconds=30)


class TorchGroupMember:
    """The receiving side of rollout/engines/base.py's ReceivesFromGroup, done with SGLang's torch.distributed calls."""

    receives_from_group = True
    device = torch.device("cpu")

    def __init__(self, out: pathlib.Path, layout):
        self.out = out
        self.layout = layout
        self.weight_version = 0
        self.joined: list[str] = []  # every group name joined, in order
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._received: dict[str, torch.Tensor] = {}

    def parameter_layout(self):
        return self.layout

    async def join_weight_group(self, spec: GroupSpec) -> None:
        await asyncio.to_thread(self._join, spec)

    def _join(self, spec: GroupSpec) -> None:
        store, rank, world_size = next(dist.rendezvous(f"tcp://{spec.master_addr}:{spec.master_port}", spec.rank,
                                                       spec.world_size, timeout=_TIMEOUT))
        store.set_timeout(_TIMEOUT)
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(spec.backend),
                                               dist.PrefixStore(spec.group_name, store), group_name=spec.group_name,
                                               timeout=_TIMEOUT)
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
        self._groups[spec.group_name] = pg
        self.joined.append(spec.group_name)

    async def receive_weights(self, manifest: Manifest, group_name: str) -> None:
        await asyncio.to_thread(self._receive, [(s.name, s.shape, s.dtype) for s in manifest.slots], group_name)

    def _receive(self, triples, group_name: str) -> None:
        weights, handles = {}, []
        for name, shape, dtype in triples:
            weights[name] = torch.empty(shape, dtype=dtype)
            handles.append(dist.broadcast(weights[name], src=0, group=self._groups[group_name], async_op=True))
        for handle in handles:
            handle.wait()
        self._received = weights

    async def serve_received(self, version: int) -> float:
        self.weight_version = version
        torch.save({"tensors": self._received, "joined": self.joined}, self.out / f"v{version}.pt")
        return 0.0

    async def leave_weight_group(self, group_name: str) -> None:
        dist.destroy_process_group(self._groups.pop(group_name))


def main(port_file: str, out: str, model: str | None = None) -> None:
    layout = LAYOUT if model is None else checkpoint_layout(model, torch.float32)
    receiver = WeightReceiver(TorchGroupMember(pathlib.Path(out), layout))
    asyncio.run(serve("member", [(weights_pb2_grpc.add_WeightSyncServicer_to_server, receiver,
                                  "relayrl.weights.v1.WeightSync")], ServerConfig(port_file=port_file)))


if __name__ == "__main__":
    main(*sys.argv[1:])
