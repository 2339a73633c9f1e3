"""Weight updates to a vLLM engine with tensor_parallel_size > 1, through vLLM's own NCCL weight transfer
(vllm.distributed.weight_transfer, the `nccl` backend of EngineArgs' weight_transfer_config).

The rollout service's process holds the update (its WeightReceiver staged it on `weight_relay_device`) and is
rank 0 of an NCCL group with vLLM's tensor-parallel workers (ranks 1..TP). vLLM's trainer-side
NCCLTrainerWeightTransferEngine sends: start_weight_update, then each tensor broadcast from rank 0 while the
workers' update_weights receive it (each keeps its own shard, loaded through model.load_weights in vLLM's
layerwise-reload lifecycle), then finish_weight_update. The group is formed at the first update and kept.

GPU only: NCCL refuses two ranks on one GPU, so the relay device is a GPU none of the workers uses
(VllmSettings.weight_relay_device). Written against vLLM 0.32; not run here (these machines have no GPU).
"""

import socket
from collections.abc import Iterator

import torch


class _EngineClient:
    """vLLM's VLLMWeightSyncClient protocol over the in-process LLMEngine: each call reaches every worker."""

    def __init__(self, llm):
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info) -> None:
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.collective_rpc("finish_weight_update")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class NcclRelay:
    """Sends whole (Hugging Face-named) updates from this process to vLLM's TP workers over NCCL."""

    def __init__(self, llm, tensor_parallel_size: int, device: torch.device):
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )

        class Update(WeightSource):
            """The update being sent (replaced before each send)."""

            def __init__(self):
                self.items: list[tuple[str, torch.Tensor]] = []

            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in self.items]

            def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
                return iter(self.items)

        self.device = device
        self.update = Update()
        init = NCCLTrainerInitInfo(master_address="127.0.0.1", master_port=_free_port(),
                                   world_size=1 + tensor_parallel_size, rank=0)
        with torch.cuda.device(device):  # vLLM's trainer side takes the current CUDA device
            self.sender = NCCLTrainerWeightTransferEngine.trainer_init(init, client=_EngineClient(llm),
                                                                       source=self.update)

    def send(self, items: list[tuple[str, torch.Tensor]]) -> None:
        """Broadcast every tensor to the workers and load it there (returns once loaded)."""
        self.update.items = [(name, tensor.to(self.device)) for name, tensor in items]
        try:
            with torch.cuda.device(self.device):
                self.sender.send_weights()
        finally:
            self.update.items = []
