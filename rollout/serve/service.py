"""The rollout service: `relayrl serve rollout --model PATH`.

Three layers: the engine (pure logic behind the engine interface, rollout/engines/base.py: native, vLLM or
SGLang as `engine.type` says), RolloutServicer (proto <-> domain, status codes), and serve() wiring both into
the shared runtime with the WeightSync receiver. Heavy imports (torch, the engine) happen inside serve(),
after the config has been parsed.
"""

import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import grpc
from prometheus_client import Gauge

from protos import rollout_pb2, rollout_pb2_grpc
from protos.codec import CodecError, decode_array, encode_array
from rollout.engine.errors import DuplicateRequest, EngineDead, InvalidRequest, QueueFull
from rollout.engine.sampling_params import SamplingParams, logprobs_temperature
from rollout.serve.config import ReplicaConfig
from rollout.serve.session_service import SessionRPCs
from rollout.serve.wire import (
    FINISH_REASONS,
    REFUSAL_CODES,
    SERVICE_NAME,
    TOKENS_GENERATED,
    generate_chunk,
    routes_array,
)
from services import tracing

if TYPE_CHECKING:
    from rollout.engine.outputs import Completion
    from rollout.engines.base import RolloutEngine
    from rollout.serve.images import ImageReader, ReadImage

RUNNING_SEQS = Gauge("relayrl_rollout_running_sequences", "Sequences in the running batch")
WAITING_SEQS = Gauge("relayrl_rollout_waiting_sequences", "Sequences waiting for KV blocks or a batch slot")
FREE_BLOCKS = Gauge("relayrl_rollout_free_kv_blocks", "KV cache blocks on the free list")
WEIGHT_VERSION = Gauge("relayrl_rollout_weight_version", "Weight version used for new tokens")
PREFILL_TOKENS = Gauge("relayrl_rollout_prefill_tokens", "Tokens computed by prefill so far (prompts, session turns, "
                       "recomputes): a session turn adds only its new tokens")
OPEN_SESSIONS = Gauge("relayrl_rollout_open_sessions", "Multi-turn sessions open")
SESSION_BLOCKS = Gauge("relayrl_rollout_session_kv_blocks", "KV blocks held by idle sessions between turns")
PREFIX_QUERIED_TOKENS = Gauge("relayrl_rollout_prefix_cache_queried_tokens", "Prompt tokens looked up in the "
                              "prefix cache so far")
PREFIX_HIT_TOKENS = Gauge("relayrl_rollout_prefix_cache_hit_tokens", "Prompt tokens whose KV the prefix cache "
                          "supplied so far (hit rate = hits / queried)")
KV_EVICTED_TOKENS = Gauge("relayrl_rollout_kv_evicted_tokens", "Tokens whose KV was evicted so far (kv_eviction)")
KV_BYTES_PER_TOKEN = Gauge("relayrl_rollout_kv_cache_bytes_per_token", "KV cache bytes per token as stored (every "
                           "layer, keys and values), labelled by engine.kv_cache_dtype", ["kv_cache_dtype"])
SESSION_EVICTIONS = Gauge("relayrl_rollout_session_kv_evictions", "Idle sessions whose KV was dropped so far "
                          "(recomputed on their next turn)")
LORA_VERSIONS = Gauge("relayrl_rollout_lora_versions_resident", "LoRA adapter versions served unmerged now "
                      "(engine.lora.versions_resident at most)")
VERSION_MOVES = Gauge("relayrl_rollout_policy_version_moves", "Started sequences a weight update moved off the "
                      "version they started on so far (a new base, kv_on_update recompute, or their adapter left)")
# Idle sessions' KV under pressure (engine.session_*: rollout/kv/host_tier.py, rollout/engine/session_policy.py)
SESSION_TIER_GAUGES = {key: Gauge(f"relayrl_rollout_{key}", doc) for key, doc in {
    "session_tier_puts": "Idle sessions whose KV went to the host tier so far",
    "session_tier_hits": "Session turns whose KV came back from the host tier so far (instead of a recompute)",
    "session_tier_dropped": "Host tier entries dropped for room so far (those sessions recompute)",
    "session_tier_misses": "Session turns whose tiered KV found no free blocks so far (recomputed)",
    "session_tier_bytes_out": "Bytes copied into the host tier so far",
    "session_tier_bytes_in": "Bytes copied back from the host tier so far",
    "session_tier_bytes": "Bytes the host tier holds now",
    "session_tier_tokens_restored": "Tokens whose KV came back from the host tier instead of being recomputed so far",
    "sessions_queued": "Sessions waiting for admission now (session_admission kv)",
    "sessions_queued_total": "Sessions that waited for admission so far",
    "sessions_admitted_late": "Sessions admitted at their wait bound though the working set did not fit, so far",
    "session_admission_wait_s": "Seconds sessions waited for admission so far (all of them)",
    "session_admission_max_wait_s": "The longest a session waited for admission so far",
}.items()}

_STATS_GAUGES = {  # engine.stats key -> its gauge
    "running": RUNNING_SEQS, "waiting": WAITING_SEQS, "free_blocks": FREE_BLOCKS, "prefill_tokens": PREFILL_TOKENS,
    "prefix_cache_queried_tokens": PREFIX_QUERIED_TOKENS, "prefix_cache_hit_tokens": PREFIX_HIT_TOKENS,
    "sessions": OPEN_SESSIONS, "session_blocks": SESSION_BLOCKS, "session_evictions": SESSION_EVICTIONS,
    "kv_evicted_tokens": KV_EVICTED_TOKENS, "lora_versions_resident": LORA_VERSIONS,
    "policy_version_moves": VERSION_MOVES, **SESSION_TIER_GAUGES,
}

MAX_VERSION_WAIT_S = 60.0  # the longest GetWeightVersion watch

class RolloutServicer(SessionRPCs, rollout_pb2_grpc.RolloutServicer):
    """Generate / GenerateStream / Abort / GetWeightVersion / GetModelInfo / ComputeLogprobs / GetLoad over an engine
    (rollout/engines/base.py), and the session RPCs (rollout/serve/session_service.py)."""

    def __init__(self, engine: "RolloutEngine", model_name: str, tokenizer, buffer_channel=None,
                 buffer_timeout_s: float = 30.0, images: "ImageReader | None" = None):
        self.engine = engine
        self.images = images  # reads a request's image parts (a vision-language model); None: text only
        self.buffer_channel = buffer_channel  # grpc.aio.Channel to the replay buffer, or None
        self.buffer_timeout_s = buffer_timeout_s
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.decode_text = _text_decoder(tokenizer)
        info = engine.info
        self.vocab_size = info.vocab_size
        self.eos_token_id = info.eos_token_ids[0] if info.eos_token_ids else -1
        self.max_model_len = info.max_model_len
        self.openai_port = 0  # the OpenAI-compatible endpoint's, once it serves (GetLoad tells a router)

    async def Generate(self, request: rollout_pb2.GenerateRequest, context) -> rollout_pb2.GenerateResponse:
        request_id, prompt, params, images = self._parse(request)
        done = await self._generate_all(request_id, prompt, params, context, images)
        if tracing.enabled():
            engine_spans(request_id, done)
        return self._response(request, request_id, prompt, params, done, images)

    async def GenerateMany(self, request: rollout_pb2.GenerateManyRequest, context) -> rollout_pb2.GenerateManyResponse:
        parsed = []
        for i, one in enumerate(request.requests):
            try:
                parsed.append(self._parse(one))
            except CodecError as exc:
                raise CodecError(f"requests[{i}].{exc}") from None
        if not parsed:
            raise CodecError("requests: give at least one request")
        ids = [request_id for request_id, _, _, _ in parsed]
        if len(set(ids)) < len(ids):
            raise CodecError("requests: request_ids must be distinct")
        try:  # together: the same requests are batched alike whatever the engine was doing (deterministic runs)
            results = await self.engine.generate_all_many([
                (request_id, prompt, params, *([[read.image for read in images]] if images else []))
                for request_id, prompt, params, images in parsed])
        except (InvalidRequest, QueueFull, DuplicateRequest, EngineDead) as exc:
            failed = getattr(exc, "request_index", None)  # None: the engine stopped while they ran
            await _abort_with_status(context, exc, "" if failed is None else f"requests[{failed}].")
        if tracing.enabled():
            for (request_id, *_), done in zip(parsed, results):
                engine_spans(request_id, done)
        return rollout_pb2.GenerateManyResponse(responses=[
            self._response(one, *parsed_one[:3], done, parsed_one[3])
            for one, parsed_one, done in zip(request.requests, parsed, results)])

    def _response(self, request: rollout_pb2.GenerateRequest, request_id: str, prompt: list[int],
                  params: SamplingParams, done: list["Completion"],
                  images: list["ReadImage"] = ()) -> rollout_pb2.GenerateResponse:
        with_logprobs = request.params.logprobs
        logprobs_t = logprobs_temperature(self.engine.info.logprobs_mode, params.temperature)
        completions = []
        for completion in done:
            TOKENS_GENERATED.inc(len(completion.token_ids))
            completions.append(rollout_pb2.Completion(
                index=completion.index,
                token_ids=encode_array(completion.token_ids, "int32"),
                logprobs=encode_array(completion.logprobs, "float32") if with_logprobs else None,
                weight_versions=encode_array(completion.weight_versions, "int64"),
                finish_reason=FINISH_REASONS[completion.finish_reason],
                text=self.decode_text(completion.token_ids),
                logprobs_temperature=logprobs_t,
                kv_version=completion.kv_version,
                routed_experts=routes_array(completion.routed_experts),
            ))
        response = rollout_pb2.GenerateResponse(request_id=request_id, completions=completions,
                                                prompt_tokens=len(prompt))
        if images:  # the prompt as the engine ran it, and what a sample records of each image
            response.prompt_ids.CopyFrom(encode_array(prompt, "int32"))
            response.images.extend(read.ref() for read in images)
        return response

    async def GenerateStream(self, request: rollout_pb2.GenerateRequest, context) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        request_id, prompt, params, images = self._parse(request)
        async for delta in self._generate(request_id, prompt, params, context, images):
            yield generate_chunk(request_id, delta, request.params.logprobs, self.decode_text(delta.token_ids))

    async def Abort(self, request: rollout_pb2.AbortRequest, context) -> rollout_pb2.AbortResponse:
        return rollout_pb2.AbortResponse(found=await self.engine.abort(request.request_id))

    async def GetWeightVersion(self, request, context) -> rollout_pb2.GetWeightVersionResponse:
        if not 0 <= request.wait_s <= MAX_VERSION_WAIT_S:  # also false for NaN
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"wait_s: must be within [0, {MAX_VERSION_WAIT_S:g}] seconds, got {request.wait_s}")
        version = self.engine.weight_version
        if request.wait_s > 0:
            version = await self.engine.watch_version(request.newer_than, request.wait_s)
        return rollout_pb2.GetWeightVersionResponse(version=version)

    async def GetModelInfo(self, request, context) -> rollout_pb2.GetModelInfoResponse:
        return rollout_pb2.GetModelInfoResponse(
            model=self.model_name,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            weight_version=self.engine.weight_version,
            paused=False,  # every engine switches weights between steps without pausing
            eos_token_id=self.eos_token_id,
            engine=self.engine.info.engine,
        )

    async def GetLoad(self, request, context) -> rollout_pb2.GetLoadResponse:
        stats = self.engine.stats
        return rollout_pb2.GetLoadResponse(
            free_blocks=stats.get("free_blocks", 0), num_blocks=stats.get("num_blocks", 0),
            running=stats.get("running", 0), waiting=stats.get("waiting", 0), weight_version=self.engine.weight_version,
            sessions=stats.get("sessions", 0), openai_port=self.openai_port)

    async def ComputeLogprobs(self, request: rollout_pb2.ComputeLogprobsRequest, context) -> rollout_pb2.ComputeLogprobsResponse:
        prompt = decode_array(request.prompt_ids, field="prompt_ids", expect="int32").tolist()
        responses = [decode_array(r, field=f"response_ids[{i}]", expect="int32").tolist()
                     for i, r in enumerate(request.response_ids)]
        prompt, images = self._with_images(prompt, request.images)
        try:
            logprobs, version = await self.engine.compute_logprobs(prompt, responses, request.temperature or 1.0,
                                                                   **images)
        except (InvalidRequest, QueueFull, EngineDead) as exc:
            await _abort_with_status(context, exc)
        return rollout_pb2.ComputeLogprobsResponse(
            logprobs=[encode_array(values, "float32") for values in logprobs], weight_version=version)

    async def _generate(
        self, request_id: str, prompt: list[int], params: SamplingParams, context, images: list["ReadImage"] = ()
    ) -> AsyncIterator["Completion"]:
        """The engine's deltas, with refusals turned into status codes. Cancelling the call aborts the request."""
        try:
            async for delta in self.engine.generate(request_id, prompt, params, **_image_inputs(images)):
                TOKENS_GENERATED.inc(len(delta.token_ids))
                yield delta
        except (InvalidRequest, QueueFull, DuplicateRequest, EngineDead) as exc:
            await _abort_with_status(context, exc)

    async def _generate_all(
        self, request_id: str, prompt: list[int], params: SamplingParams, context, images: list["ReadImage"] = ()
    ) -> list["Completion"]:
        """The finished completions, with refusals turned into status codes. Cancelling the call aborts the request."""
        try:
            return await self.engine.generate_all(request_id, prompt, params, **_image_inputs(images))
        except (InvalidRequest, QueueFull, DuplicateRequest, EngineDead) as exc:
            await _abort_with_status(context, exc)

    def _parse(self, request: rollout_pb2.GenerateRequest) -> tuple[str, list[int], SamplingParams, list["ReadImage"]]:
        """Request -> (request id, prompt ids, params, images read); raises CodecError (INVALID_ARGUMENT) naming the
        field. With images, the prompt's one-token image runs are expanded to the images' token counts."""
        prompt_ids = decode_array(request.prompt_ids, field="prompt_ids", expect="int32")
        if prompt_ids.size and request.prompt_text:
            raise CodecError("prompt_ids: give prompt_ids or prompt_text, not both")
        prompt = self.tokenizer(request.prompt_text).input_ids if request.prompt_text else prompt_ids.tolist()
        images = self._read_images(request.images)
        prompt = self.images.expand(prompt, images) if images else prompt
        return request.request_id or uuid.uuid4().hex, prompt, self._params(request.params), images

    def _read_images(self, parts) -> list["ReadImage"]:
        """A request's image parts read (CodecError names a bad one); [] without parts."""
        if not parts:
            return []
        if self.images is None or self.engine.info.engine != "native":
            raise CodecError(f"images: this server ({self.engine.info.engine} engine, {self.model_name}) takes no "
                             "images: it serves a text-only model, or an engine without image support yet")
        return self.images.read(list(parts))

    def _with_images(self, tokens: list[int], parts) -> tuple[list[int], dict]:
        """A session call's tokens with their image runs expanded, and the engine call's images argument ({} when
        it has none: every engine takes that call)."""
        images = self._read_images(parts)
        return (self.images.expand(tokens, images) if images else tokens), _image_inputs(images)

    @staticmethod
    def _params(p: rollout_pb2.SamplingParams) -> SamplingParams:
        return SamplingParams(
            temperature=p.temperature if p.HasField("temperature") else 1.0,
            top_p=p.top_p if p.HasField("top_p") else 1.0,
            top_k=p.top_k,
            max_tokens=p.max_tokens,
            stop_token_ids=tuple(p.stop_token_ids),
            stop=tuple(p.stop),
            n=p.n or 1,
            seed=p.seed if p.HasField("seed") else None,
            ignore_eos=p.ignore_eos,
        )


def _image_inputs(images: list["ReadImage"]) -> dict:
    """The engine call's images argument: none for a text-only request (every engine takes that call)."""
    return {"images": [read.image for read in images]} if images else {}


def _text_decoder(tokenizer) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, straight to the Rust tokenizer when that is all it does.

    transformers' decode first converts and checks its input in Python, which costs more than decoding
    the few tokens of a completion.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
    return lambda ids: backend.decode(ids, skip_special_tokens=True)


async def _abort_with_status(context, exc: Exception, where: str = "") -> None:
    """End the call with the status code of an engine refusal (EngineDead: UNAVAILABLE), its message after `where`."""
    code = grpc.StatusCode.UNAVAILABLE
    for kind, kind_code in REFUSAL_CODES:
        if isinstance(exc, kind):
            code = kind_code
            break
    await context.abort(code, where + str(exc))


def engine_spans(request_id: str, completions: list["Completion"]) -> None:
    """A traced call's engine spans, each completion's queue wait, prefill and decode, as children of the current
    (server) span, made after the fact from the times the engine kept (Sequence.timing): nothing for an untraced
    call, and nothing on the engine's thread."""
    parent = tracing.current_traceparent()
    if parent is None:
        return
    for completion in completions:
        if completion.timing is None or None in completion.timing:
            continue
        arrival, scheduled, first_token, finished = completion.timing
        where = {"request_id": request_id, "index": completion.index}
        tracing.record_span("engine.queue", parent, arrival, scheduled, **where)
        tracing.record_span("engine.prefill", parent, scheduled, first_token, **where)
        tracing.record_span("engine.decode", parent, first_token, finished, tokens=len(completion.token_ids), **where)


async def serve_engine(config: ReplicaConfig) -> None:
    """Load the model, start the engine thread, and serve Rollout (+ WeightSync) until SIGTERM."""
    from protos import weights_pb2_grpc
    from rollout.engines import start_engine
    from rollout.serve.weight_receiver import WeightReceiver
    from services.client import connect
    from services.device import peak_memory
    from services.flops import device_peak
    from services.runtime import serve as serve_forever
    from services.runtime import setup_logging

    setup_logging("rollout", config.server.log_level)  # before the OpenAI endpoint logs its port
    engine = start_engine(config.model, config.engine)
    for key, gauge in _STATS_GAUGES.items():
        if key in engine.stats:  # each engine reports the counters it keeps
            gauge.set_function(lambda key=key: engine.stats[key])
    WEIGHT_VERSION.set_function(lambda: engine.weight_version)
    if "kv_cache_bytes_per_token" in engine.stats:
        KV_BYTES_PER_TOKEN.labels(kv_cache_dtype=config.engine.kv_cache_dtype).set(
            engine.stats["kv_cache_bytes_per_token"])
    buffer_channel = connect(config.buffer, config.buffer_client) if config.buffer else None
    from rollout.serve.images import ImageReader

    servicer = RolloutServicer(engine, config.model, engine.tokenizer, buffer_channel, config.buffer_timeout_s,
                               ImageReader.for_model(config.model, config.images))
    receiver = WeightReceiver(engine)
    openai_server = None
    if config.openai is not None:  # up before the port file appears, so a ready service serves both
        from rollout.serve.openai_api import serve_openai

        openai_server = await serve_openai(config.openai, engine, engine.tokenizer, config.model,
                                           servicer.submit_episode if buffer_channel is not None else None,
                                           servicer.images)
        servicer.openai_port = openai_server.port

    async def on_stop() -> None:
        if openai_server is not None:
            await openai_server.stop()
        engine.shutdown()
        if buffer_channel is not None:
            await buffer_channel.close()

    await serve_forever(
        "rollout",
        [
            (rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, SERVICE_NAME),
            (weights_pb2_grpc.add_WeightSyncServicer_to_server, receiver, "relayrl.weights.v1.WeightSync"),
        ],
        config.server,
        on_stop,
        # the engine's stage reports (rollout/engine/step_stats.py), utilisation over its device's peak
        # (engine/accelerator: whether its idle time is a device of its own, relayrl doctor's trainer-bound verdict)
        stage_report=(lambda: {**engine.step_stats.report(), "engine/peak_memory_gb": peak_memory(engine.device) / 1e9,
                               "engine/accelerator": float(engine.device.type != "cpu")})
        if getattr(engine, "step_stats", None) is not None else None,
        peak_flops=lambda: device_peak(engine.device)[0],
    )
