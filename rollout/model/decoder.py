"""Qwen2 / Qwen3 / Llama decoder in plain torch, over the paged KV cache; the base other architectures build on
(rollout/model/registry.py: a family whose layers differ overrides CausalLM.make_mlp and, for checkpoint names
that are parts of its parameters, CausalLM.weight_alias).

Parameter names equal the Hugging Face checkpoint names (`model.layers.0.self_attn.q_proj.weight`,
`lm_head.weight`, ...), so checkpoints and trainer state dicts load by name, in place. q/k/v and
gate/up are stored merged (one matmul each); their checkpoint-named parameters are views into the
merged matrices (see layers.ProjectionView). Build the model on its final device and dtype: a
later `.to()` would copy parameters and buffers apart and break those views.
"""

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from rollout.config import ModelConfig
from rollout.kv.cache import KVCache
from rollout.model.attention import AttentionMetadata, paged_attention
from rollout.model.layers import RMSNorm, RotaryEmbedding, add_merged_projections, merge_parts, rebind_merged

# Checkpoint entries that are not parameters (older exports carry the RoPE buffer).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = {"q_proj": q_size, "k_proj": kv_size, "v_proj": kv_size}
        add_merged_projections(self, "qkv", config.hidden_size, parts, config.attention_bias, dtype, device)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False, dtype=dtype, device=device)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
        self.qk_norm = config.qk_norm
        self.scale = self.head_dim**-0.5
        self.adapter_keys = {"qkv": tuple(parts), "o_proj": ("o_proj",)}  # what LoRA may adapt (rollout/model/lora.py)
        self.adapters = None  # the engine's ResidentAdapters, when it serves LoRA unmerged

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rotary: RotaryEmbedding, cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        heads, kv_heads = self.num_heads, self.num_kv_heads
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        if self.adapters is not None:
            qkv = self.adapters.apply(self.adapter_ids["qkv"], x, qkv)
        qkv = qkv.view(x.shape[0], heads + 2 * kv_heads, self.head_dim)
        v = qkv[:, heads + kv_heads :]
        if self.qk_norm:
            q = rotary.apply(self.q_norm(qkv[:, :heads]), *rope)
            k = rotary.apply(self.k_norm(qkv[:, heads : heads + kv_heads]), *rope)
        else:  # q and k rotate together: one rotation for both
            qk = rotary.apply(qkv[:, : heads + kv_heads], *rope)
            q, k = qk[:, :heads], qk[:, heads:]
        attended = paged_attention(q, k, v, self.layer, cache, meta, self.scale)
        out = F.linear(attended, self.o_proj.weight)
        return out if self.adapters is None else self.adapters.apply(self.adapter_ids["o_proj"], attended, out)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        parts = {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
        add_merged_projections(self, "gate_up", config.hidden_size, parts, False, dtype, device)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype, device=device)
        self.adapter_keys = {"gate_up": tuple(parts), "down_proj": ("down_proj",)}  # (rollout/model/lora.py)
        self.adapters = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_weight)
        if self.adapters is not None:
            gate_up = self.adapters.apply(self.adapter_ids["gate_up"], x, gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        out = F.linear(hidden, self.down_proj.weight)
        return out if self.adapters is None else self.adapters.apply(self.adapter_ids["down_proj"], hidden, out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.self_attn = Attention(config, layer, dtype, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], rotary: RotaryEmbedding, cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, rotary, cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                 make_mlp: Callable[[int], nn.Module]):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, dtype, device, make_mlp(i))
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.rotary_emb = RotaryEmbedding(config, max_positions, dtype, device)


class CausalLM(nn.Module):
    """The decoder plus its LM head. forward() runs the new tokens of a batch; logits() projects rows."""

    mrope = False  # whether positions are 3-D (temporal, height, width; a vision-language model's M-RoPE)

    def __init__(self, config: ModelConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                 head_fp32: bool = False):
        super().__init__()
        self.config = config
        # The LM head in float32 even when the model computes in bf16/fp16 (the trainer's `lm_head_fp32` twin): a
        # low-precision head alone moves logprobs by tenths of a nat at a large vocabulary. Its float32 weight is
        # kept beside the served one: the published tensor itself when it arrives in float32 (a checkpoint, an
        # update), else made from the served weight after every update that carries the head.
        self.head_fp32 = head_fp32 and dtype != torch.float32
        self._head32: torch.Tensor | None = None
        self.model = Backbone(config, max_positions, dtype, device, lambda layer: self.make_mlp(layer, dtype, device))
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device)
        self.requires_grad_(False)

    def make_mlp(self, layer: int, dtype: torch.dtype, device: torch.device) -> nn.Module:
        """The feed-forward block of layer `layer` (x [T, hidden] -> [T, hidden]): a dense gated MLP."""
        return MLP(self.config, dtype, device)

    def published_name(self, name: str) -> str:
        """The name a trainer's state dict gives parameter `name` (what a weight update carries): the same for the
        text families; a family whose in-memory names differ from its checkpoint's maps them (weight_alias reverses)."""
        return name

    def weight_alias(self, name: str) -> tuple[str, tuple] | None:
        """(parameter name, index) when checkpoint name `name` is a part of a parameter (the part is
        parameter[index]); None when it names a whole parameter. Dense models have no such names."""
        return None

    def routed_experts(self) -> torch.Tensor | None:
        """The experts each token of the last forward was routed to, [T, sparse layers, top_k], of a
        mixture-of-experts model (routing replay, R3); None for a dense one."""
        return None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
        embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the new tokens, after the final norm; writes their KV. `embeds` (rows,
        values [rows, hidden]) replace the token embeddings of those rows (an image's, rollout/model/qwen2_5_vl.py);
        `positions` are [T], or [3, T] for a model with multimodal rotary positions (`mrope`)."""
        x = self.model.embed_tokens(input_ids)
        if embeds is not None:
            x = x.index_copy(0, embeds[0], embeds[1].to(x.dtype))
        rotary = self.model.rotary_emb
        rope = rotary.tables(positions)
        for layer in self.model.layers:
            x = layer(x, rope, rotary, cache, meta)
        return self.model.norm(x)

    @property
    def head_name(self) -> str:
        """The parameter the LM head multiplies by (the embedding when tied)."""
        return "model.embed_tokens.weight" if self.config.tie_word_embeddings else "lm_head.weight"

    def _keep_head(self, loaded: dict[str, torch.Tensor]) -> None:
        """After loading `loaded` (target name -> the tensor given): the float32 head from the given tensor when it
        is float32 (unrounded), forgotten (made again from the served weight) when the head came in another dtype."""
        tensor = loaded.get(self.head_name)
        if tensor is None or not self.head_fp32:
            return
        if tensor.dtype != torch.float32:
            self._head32 = None
        elif self._head32 is not None and self._head32.shape == tensor.shape:
            self._head32.copy_(tensor)
        else:
            self._head32 = tensor.to(self.model.norm.weight.device, torch.float32, copy=True).contiguous()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        if not self.head_fp32:
            return F.linear(hidden, weight)
        if self._head32 is None:
            self._head32 = weight.float()
        return F.linear(hidden.float(), self._head32)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy tensors into the parameters of the same name, in place; returns the names loaded.

        All-or-nothing: every name and shape is checked before the first copy, so a bad update
        (unknown name, wrong shape: ValueError) leaves the weights as they were. `lm_head.weight`
        of a tied model lands in the embedding.
        """
        params = dict(self.named_parameters())
        targets = [(*self._parameter_for(name, tensor, params), tensor) for name, tensor in named_tensors
                   if not name.endswith(_IGNORED_SUFFIXES)]
        for _, param, index, tensor in targets:
            (param if index is None else param[index]).copy_(tensor)
        self._keep_head({name: tensor for name, _, _, tensor in targets})
        return {name for name, _, _, _ in targets}

    def adopt_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Serve the given tensors as the parameters, without copying them where their layout allows.

        The update must name every parameter. Afterwards the model holds none of its previous weight
        storage, so the caller may reuse the memory of the version it replaced; it must not write the
        given tensors while the model serves them. Merged projections (q/k/v, gate/up) take their parts
        without a copy when these lie back to back in one storage in merge order; other layouts, other
        dtypes or devices are copied into new tensors. All-or-nothing like load_weights.
        """
        params, merged_names = self._adoption_index()
        new: dict[str, torch.Tensor] = {}
        head = {}
        part_elements: dict[str, int] = {}  # of parameters given in parts (an expert each): the elements given
        for name, tensor in named_tensors:
            if not name.endswith(_IGNORED_SUFFIXES):
                target, param, index = self._parameter_for(name, tensor, params)
                if index is None:
                    new[target] = tensor.detach().to(param.device, param.dtype)
                else:  # gathered into a new tensor: parts arrive one by one
                    new.setdefault(target, torch.empty_like(param))[index].copy_(tensor)
                    part_elements[target] = part_elements.get(target, 0) + tensor.numel()
                if target == self.head_name:
                    head[target] = tensor
        partial = [name for name, count in part_elements.items() if count != params[name].numel()]
        if len(new) != len(params) or partial:
            missing = sorted(set(params) - set(new)) + partial
            raise ValueError(f"an adopted update must carry every parameter; it lacks {len(missing)}, e.g. {missing[:3]}")
        merged = [(owner, prefix, kind, merge_parts([new.pop(name) for name in names]))
                  for owner, prefix, kind, names in merged_names]
        singles = [(params[name], tensor.contiguous()) for name, tensor in new.items()]
        for owner, prefix, kind, tensor in merged:
            rebind_merged(owner, prefix, kind, tensor)
        for param, tensor in singles:
            param.data = tensor
        self._keep_head(head)

    def _adoption_index(self) -> tuple[dict[str, nn.Parameter], list[tuple[nn.Module, str, str, list[str]]]]:
        """The parameters by name, and (owner, prefix, kind, part parameter names) of every merged matrix.
        Built once: the module tree never changes and adoption keeps the Parameter objects."""
        if getattr(self, "_adoption_cache", None) is None:
            merged = []
            for owner_name, owner in self.named_modules():
                for prefix, parts in getattr(owner, "merged_projections", {}).items():
                    for kind in ("weight", "bias"):
                        if getattr(owner, f"{prefix}_{kind}") is not None:
                            merged.append((owner, prefix, kind, [f"{owner_name}.{part}.{kind}" for part in parts]))
            self._adoption_cache = (dict(self.named_parameters()), merged)
        return self._adoption_cache

    def load_checkpoint(self, folder: str | Path) -> None:
        """Load every parameter from the folder's *.safetensors files; a missing parameter is an error."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in iter_safetensors(folder):  # one tensor at a time: no second copy of the model
            if not name.endswith(_IGNORED_SUFFIXES):
                target, param, index = self._parameter_for(name, tensor, params)
                (param if index is None else param[index]).copy_(tensor)
                loaded.add(target)
                if target == self.head_name:
                    self._keep_head({target: tensor})
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint {folder} lacks {len(missing)} parameters, e.g. {missing[:3]}")

    def _parameter_for(
        self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter]
    ) -> tuple[str, nn.Parameter, tuple | None]:
        """(parameter name, parameter, index of the part `name` is, or None for the whole), shape checked."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            name = "model.embed_tokens.weight"
        target, index = self.weight_alias(name) or (name, None)
        if target not in params:
            raise ValueError(f"weight {name!r} is not a parameter of this {self.config.model_type} model")
        param = params[target]
        shape = tuple(param.shape if index is None else param[index].shape)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != parameter shape {shape}")
        return target, param, index


def iter_safetensors(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of a single-file or sharded (model.safetensors.index.json) checkpoint."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    for file in files:
        with safe_open(folder / file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not iterable
                yield name, handle.get_tensor(name)
