"""SGLang's weight updates (SglangEngine's mixin): from the trainer's group, from staged tensors, and a LoRA policy's
adapters served unmerged (SglangSettings.lora.mode unmerged; rollout/engines/lora_versions.py).

- Tensor parallel size 1: SGLang's scheduler joins the trainer's group itself and receives every tensor
  (`init_weights_update_group`, `update_weights_from_distributed`); otherwise, and for LoRA unmerged, the rollout
  service stages the update and hands it over with `update_weights_from_tensor`.
- LoRA unmerged: each adapter-only version is loaded from the update's tensors through SGLang's
  `load_lora_adapter_from_tensors` (PEFT names, lora_alpha = r: the published B is pre-scaled) as adapter
  `relayrl-v<version>`; a request is sent with the adapter of the version served when it started (`lora_path`) and its
  tokens carry that version; a version is unloaded once it is older than the newest versions_resident and no running
  request is pinned to it. Merged with tensor_parallel_size 1, adapters are refused at BeginUpdate
  (rollout/serve/weight_layout.py): SGLang would receive them itself and nothing could merge them.

GPU only, as SGLang is; written against SGLang's tokenizer-manager API (sglang 0.5), not run here (no GPU).
"""

import asyncio
import time

import torch

from rollout.engine.adapter_pins import split_update
from rollout.engines.lora_versions import AdapterVersions, adapter_problem, peft_adapter
from rollout.engines.settings import SglangSettings
from services.weights import GroupSpec, Manifest


def adapter_name(version: int) -> str:
    return f"relayrl-v{version}"


def lora_server_args(settings: SglangSettings) -> dict:
    """The ServerArgs of unmerged LoRA (none in merged mode)."""
    if settings.lora.mode != "unmerged":
        return {}
    slots = settings.lora.versions_resident + 1  # one more: a new version's requests start while the rest drain
    return {"enable_lora": True, "max_lora_rank": settings.lora.max_rank, "max_loras_per_batch": slots,
            "lora_target_modules": ["all"]}


class SglangAdapters:
    """The adapter versions loaded in one SGLang engine, and which request runs on which."""

    def __init__(self, tokenizer_manager, settings: SglangSettings):
        self.manager, self.max_rank = tokenizer_manager, settings.lora.max_rank
        self.versions = AdapterVersions(settings.lora.versions_resident)
        self.pinned: dict[str, int] = {}  # request id -> the adapter version it runs on

    def pin(self, request_id: str, version: int) -> int | None:
        """Pin a starting request to `version`'s adapter; the version, or None when it has none (W alone)."""
        if version not in self.versions.resident:
            return None
        self.pinned[request_id] = version
        return version

    async def load(self, version: int, adapters: dict[str, torch.Tensor]) -> None:
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        self.versions.add(version, adapters, self.max_rank, write=False)  # checks them (ValueError)
        tensors, config = peft_adapter(adapters, self.max_rank)
        obj = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=adapter_name(version), config_dict=config,
            serialized_tensors=MultiprocessingSerializer.serialize(list(tensors.items()), output_str=True))
        reply = await self.manager.load_lora_adapter_from_tensors(obj, None)
        if not reply.success:
            self.versions.remove(version)
            raise RuntimeError(f"SGLang did not load the adapter of weight version {version}: {reply.error_message}")

    async def release(self, request_id: str | None = None) -> None:
        """Unpin a finished request; unload the versions no longer resident that no running request is pinned to."""
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        self.pinned.pop(request_id, None)
        for version in self.versions.leaving(set(self.pinned.values())):
            self.versions.remove(version)
            await self.manager.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=adapter_name(version)), None)


def _check(reply: tuple, call: str) -> None:
    """SGLang's (success, message, ...) reply; RuntimeError with its message when it failed."""
    if not reply[0]:
        raise RuntimeError(f"SGLang {call}: {reply[1]}")


class SglangWeights:
    """update_weights and the group-receiving methods (rollout/engines/base.py's ReceivesFromGroup) of SglangEngine,
    over its `sgl` (sglang.Engine), `settings`, `adapters` (SglangAdapters or None) and `_version_changed`."""

    @property
    def serves_adapters_unmerged(self) -> bool:
        """Whether LoRA adapters in an update become SGLang adapters (lora.mode unmerged)."""
        return self.adapters is not None

    def adapter_problem(self, weight: str) -> str | None:
        return adapter_problem(weight)

    async def update_weights(self, weights: dict[str, torch.Tensor], version: int, adopt: bool = False) -> float:
        """SGLang's update_weights_from_tensor (its scheduler loads them; flushes the radix cache); LoRA adapters
        among them (lora.mode unmerged) through load_lora_adapter_from_tensors, as adapter version `version`."""
        start = time.perf_counter()
        base, adapters = split_update(weights)
        if adapters and self.adapters is None:
            raise ValueError("this SGLang engine serves LoRA merged (lora.mode: merged): merge the adapters first")
        if adapters:
            await self.adapters.load(version, adapters)
        if base:
            await self._load_base(base)
        await self.serve_received(version)
        if self.adapters is not None:
            await self.adapters.release()
        self.last_pause_s = time.perf_counter() - start
        return self.last_pause_s

    async def _load_base(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        payload = MultiprocessingSerializer.serialize(weights)
        obj = UpdateWeightsFromTensorReqInput(serialized_named_tensors=[payload] * self.settings.tensor_parallel_size,
                                              flush_cache=True)
        success, message = (await self.sgl.tokenizer_manager.update_weights_from_tensor(obj, None))[:2]
        if not success:
            raise RuntimeError(f"SGLang refused the weight update: {message}")

    async def join_weight_group(self, spec: GroupSpec) -> None:
        """SGLang's scheduler joins the trainer's group (torch.distributed's named-group recipe) as rank spec.rank."""
        from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

        obj = InitWeightsUpdateGroupReqInput(master_address=spec.master_addr, master_port=spec.master_port,
                                             rank_offset=spec.rank, world_size=spec.world_size,
                                             group_name=spec.group_name, backend=spec.backend)
        _check(await self.sgl.tokenizer_manager.init_weights_update_group(obj, None), "init_weights_update_group")

    async def receive_weights(self, manifest: Manifest, group_name: str) -> None:
        """SGLang receives every tensor (one broadcast each, in slot order) and loads them, in one call."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        slots = manifest.slots
        obj = UpdateWeightsFromDistributedReqInput(
            names=[s.name for s in slots], dtypes=[str(s.dtype).removeprefix("torch.") for s in slots],
            shapes=[list(s.shape) for s in slots], group_name=group_name, flush_cache=True)
        _check(await self.sgl.tokenizer_manager.update_weights_from_distributed(obj, None),
               "update_weights_from_distributed")

    async def serve_received(self, version: int) -> float:
        """The weights SGLang loaded in receive_weights are `version` from now on."""
        self.weight_version = version
        self._version_changed.set()
        self._version_changed = asyncio.Event()
        return 0.0

    async def leave_weight_group(self, group_name: str) -> None:
        from sglang.srt.managers.io_struct import DestroyWeightsUpdateGroupReqInput

        obj = DestroyWeightsUpdateGroupReqInput(group_name=group_name)
        _check(await self.sgl.tokenizer_manager.destroy_weights_update_group(obj, None), "destroy_weights_update_group")
