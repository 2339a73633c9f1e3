"""Sharded loading: the policy is built on the meta device, split over the mesh, and each rank then reads
only its own shards from the Hugging Face safetensors files (torch.distributed.checkpoint's safetensors
reader: a slice per shard, never a whole copy of the model per rank). A mixture-of-experts folder's per-expert
names (as the Hub's checkpoints hold them) fill the fused experts tensors: read whole, then each rank keeps its shard."""

import logging
import math
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import AutoConfig

from trainer.config.model import ModelConfig
from trainer.config.parallel import ParallelConfig
from trainer.lora import apply_lora, freeze_base, has_lora, hf_base_names, init_adapters
from trainer.model import PolicyModel, auto_class, checkpoint_layers, load_policy
from trainer.moe.names import expert_parts, fuse, is_fused_experts
from trainer.parallel.compose import parallelize
from trainer.parallel.mesh import DistEnv
from trainer.vision import VisionInputs

log = logging.getLogger(__name__)


class CountingReader(HuggingFaceStorageReader):
    """The safetensors reader, counting the bytes this rank reads (the slices its shards need)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(str(path))
        self.bytes_read = 0
        self._dtypes: dict[str, torch.dtype] = {}

    def read_metadata(self):
        metadata = super().read_metadata()
        self._dtypes = {name: meta.properties.dtype for name, meta in metadata.state_dict_metadata.items()}
        return metadata

    def read_data(self, plan, planner):
        for item in plan.items:
            self.bytes_read += math.prod(item.lengths) * self._dtypes[item.storage_index.fqn].itemsize
        return super().read_data(plan, planner)


def build_policy(
    path: str | Path,
    env: DistEnv,
    config: ParallelConfig | None = None,
    model: ModelConfig | None = None,
    *,
    value_head: bool = False,
    trainable: bool = True,
    dtype: str = "float32",
    seed: int = 0,
) -> PolicyModel:
    """The policy of the Hugging Face folder `path`, split over env's mesh (float32 parameters, dropout off);
    in a world of one, loaded whole. `model`: its head's chunking and precision, and activation checkpointing
    (trainable policies only); with `model.lora` (trainable policies only) the targeted layers carry adapters
    (trainer/lora.py), drawn from `seed`, and nothing else but the value head trains."""
    model = model or ModelConfig()
    head = {"chunk_tokens": model.logprob_chunk_tokens, "lm_head_fp32": model.lm_head_fp32}
    checkpointing = checkpoint_layers if model.activation_checkpointing and trainable else None
    lora = model.lora if trainable else None
    if not env.distributed:
        policy = load_policy(path, value_head=value_head, device=env.device, **head).requires_grad_(trainable)
        if lora is not None:
            _adapt(policy, lora)
            init_adapters(policy, seed)
        _freeze_vision(policy, model)
        return parallelize(policy, env, config, dtype, checkpointing)
    with torch.device("meta"):  # a vision-language model with both towers (trainer/model.py: auto_class)
        lm = auto_class(path).from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
        policy = PolicyModel(lm, value_head=value_head, **head)
        if lora is not None:
            _adapt(policy, lora)
    policy.vision = VisionInputs.for_model(path)
    policy.eval().requires_grad_(trainable)
    if lora is not None:
        freeze_base(policy, ("value_head.",))
    _freeze_vision(policy, model)
    parallelize(policy, env, config, dtype, checkpointing)
    policy.to_empty(device=env.device)
    _init_buffers(lm)
    read = load_hf_shards(lm, path)
    if lora is not None:
        init_adapters(policy, seed)
    if policy.value_head is not None:  # a zero critic, as load_policy's
        with torch.no_grad():
            for parameter in policy.value_head.parameters():
                parameter.zero_()
    log.info("rank %d read %.1f MB of the policy's weights from %s", env.rank, read / 1e6, path)
    return policy


def _freeze_vision(policy: PolicyModel, model: ModelConfig) -> None:
    """`model.freeze_vision`: a vision-language policy's tower keeps its loaded weights (no gradient)."""
    if model.freeze_vision and hasattr(policy.lm.base_model, "visual"):
        policy.lm.base_model.visual.requires_grad_(False)


def _adapt(policy: PolicyModel, lora) -> None:
    apply_lora(policy.lm, lora.rank, lora.alpha, lora.dropout, lora.target_modules)
    freeze_base(policy, ("value_head.",))


def load_hf_shards(lm: nn.Module, path: str | Path) -> int:
    """Fill `lm`'s parameters (this rank's shards) from the safetensors files in `path`; the bytes read (a LoRA
    model's base layers by their Hugging Face names; its adapters are not in the folder)."""
    reader = CountingReader(path)
    saved = reader.read_metadata().state_dict_metadata
    state = hf_base_names(lm.state_dict()) if has_lora(lm) else lm.state_dict()
    state = {_saved_name(name, saved): tensor for name, tensor in state.items()}
    missing = set(state) - set(saved)
    head, embedding = lm.get_output_embeddings(), lm.get_input_embeddings()  # None on the stages without them
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    if tied:  # saved once, under the input embedding's name
        missing.discard("lm_head.weight")
        state.pop("lm_head.weight", None)
    experts = {name: state.pop(name) for name in sorted(missing)
               if is_fused_experts(name) and expert_parts(name, state[name].shape[0])[0][0] in saved}
    missing -= set(experts)
    if missing:
        raise ValueError(f"{path}: no weights for {sorted(missing)[:5]} ({len(missing)} in all)")
    dcp.load(state, storage_reader=reader)
    return reader.bytes_read + (_load_per_expert(experts, path) if experts else 0)


def _saved_name(name: str, saved) -> str:
    """A parameter's name in the folder: its own, or a vision-language model's in the layout checkpoints keep
    (transformers' module `model.language_model.X` saved as `model.X`, `model.visual.X` as `visual.X`)."""
    if name in saved:
        return name
    for module, folder in (("model.language_model.", "model."), ("model.visual.", "visual.")):
        if name.startswith(module) and folder + name[len(module):] in saved:
            return folder + name[len(module):]
    return name


def _load_per_expert(fused: dict[str, torch.Tensor], path: str | Path) -> int:
    """Fill the fused experts tensors `fused` (this rank's shards) from a folder that names each expert's
    projections (trainer/moe/names.py); the bytes read. Every rank reads the whole experts and keeps its shard (the
    reader addresses whole tensors, and an expert is one)."""
    parts = {name: expert_parts(name, tensor.shape[0]) for name, tensor in fused.items()}
    wanted = {}
    for name, tensor in fused.items():
        rows = tensor.shape[1] // len(parts[name][0])
        wanted.update({part: torch.empty(rows, tensor.shape[2], dtype=tensor.dtype) for expert in parts[name]
                       for part in expert})
    reader = CountingReader(path)
    dcp.load(wanted, storage_reader=reader)
    with torch.no_grad():
        for name, tensor in fused.items():
            whole = fuse([[wanted[part] for part in expert] for expert in parts[name]]).to(tensor.device)
            if isinstance(tensor, DTensor):
                tensor.to_local().copy_(distribute_tensor(whole, tensor.device_mesh, tensor.placements,
                                                          src_data_rank=None).to_local())
            else:
                tensor.copy_(whole)
    return reader.bytes_read


def _init_buffers(lm: nn.Module) -> None:
    """Recompute the buffers that are not saved (rotary inverse frequencies): to_empty left them unset."""
    rotary = [module for module in lm.modules() if hasattr(module, "original_inv_freq")]
    unsaved = {name for name, _ in lm.named_non_persistent_buffers()}
    known = {f"{prefix}.{buffer}" for prefix, module in lm.named_modules() if module in rotary
             for buffer in ("inv_freq", "original_inv_freq")}
    if unsaved - known:
        raise NotImplementedError(f"sharded loading: no initialiser for the unsaved buffers {sorted(unsaved - known)}")
    for module in rotary:
        lm._init_weights(module)
