"""Engine and model configuration: one typed dataclass each, derived fields filled and checked once."""

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from rollout.kv.quantized import block_codec
from services.device import engine_dtype, resolve_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The model types the native engine serves; each has its model class in rollout/model/registry.py.
SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_5_vl")
KV_CACHE_DTYPES = ("auto", "int8", "int4")


ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer")
# FlashInfer's paged kernel (rollout/model/attention_flashinfer.py): the dtypes and head sizes it is built for
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
KERNEL_HEAD_DIMS = (64, 128, 256)  # the head sizes FlashInfer's prefill kernels are built for


def choose_attention(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int, kv_cache_dtype: str) -> str:
    """'triton', 'flashinfer' or 'torch' for an engine's `backend` setting (one of ATTENTION_BACKENDS).

    'auto' takes the Triton kernel on CUDA when triton is importable, plain torch elsewhere; FlashInfer runs when
    asked for by name. A kernel asked for by name where it cannot run: ValueError says why."""
    if backend == "torch":
        return "torch"
    if backend in ("auto", "triton"):
        reasons = triton_reasons(device)
        if not reasons:
            return "triton" if device.type == "cuda" or backend == "triton" else "torch"
        if backend == "triton":
            raise ValueError(f"attention_backend 'triton': {'; '.join(reasons)}")
        return "torch"
    reasons = []
    if device.type != "cuda":
        reasons.append(f"it runs on CUDA devices, the engine is on {device}")
    if dtype not in KERNEL_DTYPES:
        reasons.append(f"it has float16 and bfloat16 kernels, the engine's dtype is {dtype}")
    if head_dim not in KERNEL_HEAD_DIMS:
        reasons.append(f"its kernels take head_dim {', '.join(map(str, KERNEL_HEAD_DIMS))}, the model's is {head_dim}")
    if kv_cache_dtype != "auto":
        reasons.append(f"it reads a cache in the model dtype, not kv_cache_dtype {kv_cache_dtype!r}")
    if importlib.util.find_spec("flashinfer") is None:
        reasons.append("flashinfer is not installed (pip install 'relayrl[gpu]': flashinfer-python)")
    if reasons:
        raise ValueError(f"attention_backend 'flashinfer': {'; '.join(reasons)}")
    return "flashinfer"


def choose_moe_kernel(backend: str, device: torch.device) -> str:
    """'triton' or 'torch' for an engine's `moe_backend`: 'auto' takes the fused Triton kernel on CUDA when triton is
    importable; 'triton' asked for where it cannot run: ValueError says why."""
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"moe_backend: {backend!r} is not one of auto, torch, triton")
    if backend == "torch":
        return "torch"
    reasons = triton_reasons(device)
    if backend == "triton" and reasons:
        raise ValueError(f"moe_backend 'triton': {'; '.join(reasons)}")
    return "triton" if not reasons and (device.type == "cuda" or backend == "triton") else "torch"


def triton_reasons(device: torch.device) -> list[str]:
    """Why the Triton kernel (rollout/model/attention_triton.py) cannot run on `device`; [] when it can. On CPU it runs
    in Triton's interpreter, which must be on (TRITON_INTERPRET=1) before triton is first imported: for tests."""
    reasons = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed (it comes with torch's CUDA wheels; pip install triton)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        reasons.append(f"it runs on CUDA devices (on CPU in Triton's interpreter: TRITON_INTERPRET=1), the engine is on "
                       f"{device}")
    return reasons


def choose_cuda_graphs(setting: bool | None, device: torch.device, attention_kernel: str, kv_cache_dtype: str,
                       moe: bool = False) -> bool:
    """Whether decode steps run on static buffers, replayed from CUDA graphs on CUDA (rollout/engine/cuda_graphs.py).

    None: on where it can run on CUDA. True on CPU runs the same static-buffer path with a plain call instead of a
    replay (tests). Asked for where it cannot run: ValueError says why."""
    reasons = []
    if device.type == "cuda" and attention_kernel != "triton":
        reasons.append(f"a replayed decode needs attention over fixed shapes, the Triton kernel (attention_backend "
                       f"'triton' or 'auto' with triton installed), not {attention_kernel!r}")
    if kv_cache_dtype != "auto":
        reasons.append(f"kv_cache_dtype {kv_cache_dtype!r}: the quantized cache plans its writes on the host each step")
    if device.type == "cuda" and moe:
        reasons.append("a mixture-of-experts model groups its tokens by expert on the host each step")
    if setting is None:
        return device.type == "cuda" and not reasons
    if setting and reasons:
        raise ValueError(f"cuda_graphs: {'; '.join(reasons)}")
    return setting


@dataclass(frozen=True)
class MoeConfig:
    """The mixture-of-experts facts of a Qwen3-MoE config.json (transformers' Qwen3MoeConfig, its defaults where a
    field is absent). Layer i is sparse unless listed in mlp_only_layers, when num_experts > 0 and
    (i + 1) % decoder_sparse_step == 0; the other layers run a dense MLP of the config's intermediate_size.
    Qwen3-MoE has no shared expert (transformers' Qwen3MoeSparseMoeBlock ignores one a config.json may name)."""

    num_experts: int
    num_experts_per_tok: int  # the router's top-k
    moe_intermediate_size: int  # each expert's hidden width
    norm_topk_prob: bool  # renormalise the top-k probabilities to sum to 1
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    @classmethod
    def from_raw(cls, raw: dict) -> "MoeConfig":
        return cls(
            num_experts=raw.get("num_experts", raw.get("num_local_experts", 128)),  # 5.25 saves num_local_experts
            num_experts_per_tok=raw.get("num_experts_per_tok", 8),
            moe_intermediate_size=raw.get("moe_intermediate_size", 768),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
            decoder_sparse_step=raw.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(raw.get("mlp_only_layers") or ()),
        )

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` runs the experts (else a dense MLP), as transformers' Qwen3MoeDecoderLayer decides."""
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


@dataclass(frozen=True)
class VisionConfig:
    """The vision facts of a Qwen2.5-VL config.json: its tower's own config (transformers' Qwen2_5_VLVisionConfig
    fields, built by rollout/model/qwen2_5_vl.py), the image placeholder token, and how M-RoPE splits head_dim / 2
    among the temporal, height and width positions."""

    tower: dict  # config.json's vision_config
    image_token_id: int  # the placeholder an image's embeddings replace, once per image token
    spatial_merge_size: int  # patches merged (per side) into one image token
    mrope_section: tuple[int, int, int]  # rotary frequencies driven by the temporal, height and width positions

    @classmethod
    def from_raw(cls, raw: dict) -> "VisionConfig":
        tower = raw["vision_config"]
        text = raw.get("text_config") or raw
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        return cls(tower=tower, image_token_id=raw["image_token_id"],
                   spatial_merge_size=tower.get("spatial_merge_size", 2),
                   mrope_section=tuple(rope.get("mrope_section", (16, 24, 24))))


@dataclass(frozen=True)
class ModelConfig:
    """The facts of a Hugging Face decoder checkpoint that the native engine needs (from config.json)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "linear"|"llama3", ...} or None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections (always on for Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...]
    dtype: str  # the checkpoint's own dtype name
    moe: MoeConfig | None = None  # the experts of a mixture-of-experts model (qwen3_moe); None: dense
    vision: VisionConfig | None = None  # the vision tower of a vision-language model (qwen2_5_vl); None: text only

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read config.json (and generation_config.json's eos ids) of a local model folder."""
        folder = Path(path)
        raw = json.loads((folder / "config.json").read_text())
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type: {model_type!r} is not supported (expected one of {SUPPORTED_MODEL_TYPES})")
        top = raw
        if model_type == "qwen2_5_vl":  # the decoder's facts nest in text_config (flat in older exports)
            text = top.get("text_config") or top
            raw = {**text, "tie_word_embeddings": top.get("tie_word_embeddings", False),
                   "eos_token_id": top.get("eos_token_id", text.get("eos_token_id")),
                   "dtype": top.get("dtype") or top.get("torch_dtype") or text.get("dtype")}
        if raw.get("use_sliding_window"):
            raise ValueError("use_sliding_window: sliding-window attention is not supported by the native engine")
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: only silu is supported, got {raw['hidden_act']!r}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        num_heads = raw["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=model_type in ("qwen2", "qwen2_5_vl") or raw.get("attention_bias", False),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            eos_token_ids=read_eos_token_ids(folder, raw),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            moe=MoeConfig.from_raw(raw) if model_type == "qwen3_moe" else None,
            vision=VisionConfig.from_raw(top) if model_type == "qwen2_5_vl" else None,
        )


def read_eos_token_ids(folder: Path, raw: dict) -> tuple[int, ...]:
    """eos ids of config.json and generation_config.json together (chat models list several)."""
    ids: list[int] = []
    sources = [raw.get("eos_token_id")]
    generation = folder / "generation_config.json"
    if generation.exists():
        sources.append(json.loads(generation.read_text()).get("eos_token_id"))
    for value in sources:
        for token in value if isinstance(value, list) else [value]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return tuple(ids)


@dataclass
class LoraServing:
    """A LoRA policy's adapters: unmerged, several versions resident (rollout/model/lora.py), or merged (docs/lora.md)."""

    mode: Literal["unmerged", "merged"] = "unmerged"
    versions_resident: int = 2  # at least max_staleness + 1 so a rollout finishes on its own (relayrl doctor checks)


@dataclass
class EngineConfig:
    """How the native engine runs one model.

    The KV cache holds `num_blocks` blocks of `block_size` tokens; when `num_blocks` is None it is
    sized to `kv_cache_memory_bytes`, but never beyond what `max_num_seqs` sequences of
    `max_model_len` tokens can use. A quantized cache (`kv_cache_dtype` int8 / int4,
    rollout/kv/quantized.py) also keeps `kv_open_blocks` partly written blocks in the model dtype;
    they are paid out of the same budget.
    """

    model: str  # local Hugging Face folder (config.json + *.safetensors)
    # "auto": the checkpoint's dtype; None: the device's (services.device.engine_dtype: float32 on the CPU, bfloat16 on
    # an accelerator)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = None
    # "cpu", "cuda", "cuda:1", ...; "auto": the machine's accelerator, else the CPU (services.device.resolve_device)
    device: str = "cpu"
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks; None: derived from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 1 << 30  # budget for the KV cache when num_blocks is None
    # "auto": K and V in the model dtype; "int8" / "int4": KIVI-style quantized blocks (keys per channel over a
    # block's tokens, values per token), dequantized when attention reads them (rollout/kv/quantized.py)
    kv_cache_dtype: Literal["auto", "int8", "int4"] = "auto"
    max_num_seqs: int = 64  # sequences decoded together in one step
    max_num_batched_tokens: int = 4096  # tokens computed in one step (decodes, then prefill chunks); >= max_num_seqs
    enable_prefix_caching: bool = True  # reuse the KV of full blocks whose prefix an earlier sequence computed
    # Attention reads each length class of a step's sequences apart (rollout/model/attention.py); False: all in one
    # call padded to the longest context (the path before classes; bench/rollout_throughput.py compares them).
    attention_length_classes: bool = True
    # Who computes paged attention (rollout/model/attention.py): "torch" (any device, any dtype), "triton" (the Triton
    # kernel of rollout/model/attention_triton.py: CUDA, any dtype, quantized caches; on CPU only in Triton's
    # interpreter), "flashinfer" (FlashInfer's paged kernel: CUDA, float16/bfloat16, head_dim 64/128/256,
    # kv_cache_dtype auto), "auto": triton on CUDA when triton is importable, else torch.
    attention_backend: Literal["auto", "torch", "triton", "flashinfer"] = "auto"
    # Who runs a mixture-of-experts layer's experts (rollout/model/moe.py): "torch" (grouped: one matmul pair per
    # expert), "triton" (the fused grouped GEMMs of rollout/model/moe_triton.py: CUDA; on CPU only in Triton's
    # interpreter), "auto": triton on CUDA when triton is importable, else torch. Dense models ignore it.
    moe_backend: Literal["auto", "torch", "triton"] = "auto"
    # Decode steps on static buffers replayed from CUDA graphs, one per batch-size bucket (rollout/engine/cuda_graphs.py);
    # prefill and chunked steps stay eager. None: on for CUDA with the Triton kernel and kv_cache_dtype auto. True on
    # CPU runs the static-buffer path with plain calls (tests).
    cuda_graphs: bool | None = None
    # KV eviction for long contexts (rollout/engine/kv_eviction.py): a sequence keeps at most kv_budget_tokens cache slots.
    kv_eviction: Literal["none", "window", "snapkv"] = "none"  # window: sinks + most recent; snapkv: + most attended
    kv_budget_tokens: int = 1024  # cache slots a sequence keeps when kv_eviction is on
    kv_sink_tokens: int = 4  # the first tokens, always kept (attention sinks)
    kv_observation_window: int = 16  # snapkv: the latest queries that score the past; their tokens are always kept
    max_model_len: int | None = None  # prompt + response limit; None: the model's max_position_embeddings
    max_queue: int = 1024  # requests waiting to start; beyond it add_request raises QueueFull
    max_n: int = 16  # largest n (completions per prompt) a request may ask for
    seed: int = 0  # seeds the per-request seeds of requests that bring none
    logprobs_mode: Literal["tempered", "raw", "processed"] = "tempered"  # see rollout/engine/sampler.py
    # The LM head (and so logits, sampling and logprobs) in float32 when dtype is bfloat16/float16: the trainer's
    # `lm_head_fp32` twin; together they narrow the rollout-vs-trainer mismatch (trainer/mismatch.py)
    lm_head_fp32: bool = False
    max_sessions: int = 256  # open multi-turn sessions (rollout/engine/sessions.py); beyond it OpenSession is refused
    session_idle_timeout_s: float = 600.0  # a session idle this long is closed and its blocks freed
    # What a weight update does to KV computed with the old weights (docs/sessions.md, "KV across weight updates"):
    # "keep": running sequences and idle sessions go on over it (each completion says so in its kv_version);
    # "recompute": it is dropped, and each context is recomputed with the new weights before its next token.
    kv_on_update: Literal["keep", "recompute"] = "keep"
    # Idle sessions' KV scheduling (docs/sessions.md, "KV under pressure"; rollout/engine/session_policy.py):
    # the host tier their KV goes to when it must leave the cache (rollout/kv/host_tier.py), 0: none (recomputed)
    session_kv_tier_bytes: int = 0
    session_kv_tier_codec: Literal["none", "int8", "int4"] = "none"  # plain copies, or quantized (rollout/kv/codecs.py)
    session_policy: Literal["lru", "kv_aware"] = "lru"  # whose KV leaves first: least recently used, or back last
    session_pin_ttl_s: float = 30.0  # kv_aware: a session expected back within this is pinned, for at most this long
    session_admission: Literal["none", "kv"] = "none"  # kv: new sessions queue while the working set does not fit
    session_admission_wait_s: float = 30.0  # the longest a session queues before it is admitted anyway
    lora: LoraServing = field(default_factory=LoraServing)  # adapters of a LoRA policy: unmerged or merged (a dict too)
    model_config: ModelConfig = field(init=False)  # derived: read from the model folder
    # derived: float blocks a quantized cache keeps for blocks being filled (one per running sequence; 0 for auto)
    kv_open_blocks: int = field(init=False)
    torch_dtype: torch.dtype = field(init=False)  # derived from dtype
    attention_kernel: str = field(init=False)  # derived: "torch", "triton" or "flashinfer": what attention_backend chose
    moe_kernel: str = field(init=False)  # derived: "torch" or "triton": what moe_backend chose

    def __post_init__(self) -> None:
        self.lora = LoraServing(**self.lora) if isinstance(self.lora, dict) else self.lora
        if self.lora.mode not in ("unmerged", "merged") or self.lora.versions_resident < 1:
            raise ValueError(f"lora: mode is unmerged or merged, versions_resident >= 1; got {self.lora}")
        self.model_config = ModelConfig.from_pretrained(self.model)
        if self.device == "auto":
            self.device = str(resolve_device("auto"))
        if self.dtype is None:
            self.dtype = engine_dtype(torch.device(self.device))
        dtype = self.model_config.dtype if self.dtype == "auto" else self.dtype
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not one of {sorted(DTYPES)}")
        self.torch_dtype = DTYPES[dtype]
        if self.max_model_len is None:
            self.max_model_len = self.model_config.max_position_embeddings
        if not 0 < self.max_model_len <= self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len: {self.max_model_len} is outside (0, {self.model_config.max_position_embeddings}]"
            )
        if self.kv_budget_tokens <= self.kv_sink_tokens + self.kv_observation_window:
            raise ValueError(f"kv_budget_tokens: {self.kv_budget_tokens} must exceed kv_sink_tokens + "
                             f"kv_observation_window ({self.kv_sink_tokens} + {self.kv_observation_window})")
        if self.kv_sink_tokens < 0:
            raise ValueError(f"kv_sink_tokens: must be >= 0, got {self.kv_sink_tokens}")
        for name in ("block_size", "kv_observation_window", "max_num_seqs", "max_queue", "max_n",
                     "kv_cache_memory_bytes", "max_sessions", "session_idle_timeout_s", "session_pin_ttl_s",
                     "session_admission_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens: {self.max_num_batched_tokens} cannot hold one decode token of "
                             f"each of max_num_seqs={self.max_num_seqs} sequences")
        if self.max_n > self.max_num_seqs:
            raise ValueError(f"max_n: {self.max_n} exceeds max_num_seqs={self.max_num_seqs}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: {self.kv_cache_dtype!r} is not one of {KV_CACHE_DTYPES}")
        for name, allowed in (("kv_on_update", ("keep", "recompute")), ("session_kv_tier_codec", ("none", "int8", "int4")),
                              ("session_policy", ("lru", "kv_aware")), ("session_admission", ("none", "kv"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        if self.session_kv_tier_bytes < 0:
            raise ValueError(f"session_kv_tier_bytes: must be >= 0, got {self.session_kv_tier_bytes}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: {self.attention_backend!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
        device = torch.device(self.device)
        self.attention_kernel = choose_attention(self.attention_backend, device, self.torch_dtype,
                                                 self.model_config.head_dim, self.kv_cache_dtype)
        self.moe_kernel = choose_moe_kernel(self.moe_backend, device)
        self.cuda_graphs = choose_cuda_graphs(self.cuda_graphs, device, self.attention_kernel, self.kv_cache_dtype,
                                              self.model_config.moe is not None)
        self.kv_open_blocks = 0 if self.kv_cache_dtype == "auto" else self.max_num_seqs
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        if self.num_blocks is None:
            open_bytes = self.kv_open_blocks * self.kv_float_bytes_per_block
            if open_bytes >= self.kv_cache_memory_bytes:
                raise ValueError(f"kv_cache_memory_bytes: {self.kv_cache_memory_bytes} cannot hold the {self.kv_open_blocks} "
                                 f"open float blocks ({open_bytes} bytes) of a {self.kv_cache_dtype} cache")
            self.num_blocks = min((self.kv_cache_memory_bytes - open_bytes) // self.kv_bytes_per_block,
                                  self.max_num_seqs * blocks_per_seq)
        if self.num_blocks < blocks_per_seq:
            raise ValueError(
                f"num_blocks: {self.num_blocks} blocks cannot hold one sequence of max_model_len={self.max_model_len} "
                f"({blocks_per_seq} blocks); raise kv_cache_memory_bytes or lower max_model_len"
            )

    @property
    def kv_float_bytes_per_block(self) -> int:
        """Bytes of one block's keys and values in the model dtype (every layer)."""
        m = self.model_config
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * self.torch_dtype.itemsize

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block as the cache stores it: in the model dtype, or quantized codes plus their scales."""
        if self.kv_cache_dtype == "auto":
            return self.kv_float_bytes_per_block
        m = self.model_config
        codec = block_codec(self.kv_cache_dtype, self.block_size)
        return codec.encoded_nbytes((m.num_layers, self.block_size, m.num_kv_heads, m.head_dim), self.torch_dtype)
