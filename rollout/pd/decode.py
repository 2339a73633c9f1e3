"""The decode worker: `relayrl serve decode --model PATH --set 'prefill=[HOST:PORT]'`.

It serves relayrl.rollout.v1.Rollout like `relayrl serve rollout`, but Generate and GenerateStream pull the
prompt's prefill from a prefill worker (rollout/pd/prefill.py explains the design), import it and decode.
GenerateMany, ComputeLogprobs and the session rpcs run on this worker alone, prefill included (a session's
KV stays on the worker its key is routed to). DecodeWorker.Continue decodes a transfer the caller brings.

A prompt with images (a vision-language model) is read here as the rollout service reads it (its image runs expanded)
and pulled with its images as data parts; the prefill worker runs the vision tower, and the transfer brings the
prompt's M-RoPE positions and the offset its decoded tokens continue them with (rollout/pd/transfer.py). The import
checks them against those the images give the prompt and keeps the images, should a preemption recompute the prompt.
Continue reads the images the transfer's request carries.

A transfer that does not fit is refused (INVALID_ARGUMENT, DATA_LOSS, FAILED_PRECONDITION) and the worker
goes on serving. KV computed with other weights than served is never imported (weight updates reach prefill and
decode workers a moment apart). KV of newer weights than this worker's waits, unpulled again, until this worker
serves them; KV of older weights is pulled again after a pause that doubles from 20 ms up to 2 s, at most
`max_repulls` times (each pull ships the whole prefill again), all within `import_wait_s`; then the request fails
with FAILED_PRECONDITION, saying how many pulls and bytes it took. Decoding a transfer and its CRC-32 run off the
event loop.
"""

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal

import grpc
from prometheus_client import Counter
from pydantic import Field

from protos import kv_pb2, kv_pb2_grpc, rollout_pb2
from protos.codec import encode_array
from rollout.engine.errors import (
    KVTransferCorrupt,
    KVTransferInvalid,
    KVWeightVersionMismatch,
    QueueFull,
)
from rollout.engine.outputs import Completion
from rollout.engine.sampling_params import SamplingParams
from rollout.engines.settings import NativeSettings
from rollout.pd.kv_group import KVGroup, KVGroupConfig, KVGroupError
from rollout.serve.config import ImageSettings
from rollout.serve.service import RolloutServicer
from rollout.serve.wire import REFUSAL_CODES, generate_chunk
from services.config import ClientConfig, ServerConfig, Strict

if TYPE_CHECKING:
    import torch

    from rollout.engine.async_engine import AsyncEngine
    from rollout.pd.transfer import ReceivedTransfer
    from rollout.serve.images import ImageReader, ReadImage

log = logging.getLogger(__name__)
SERVICE_NAME = "relayrl.kv.v1.DecodeWorker"
KV_BYTES = Counter("relayrl_decode_kv_transfer_bytes_total", "Encoded KV payload bytes received from prefill workers")
KV_GROUP_BYTES = Counter("relayrl_decode_kv_group_bytes_total", "Encoded KV payload bytes received over the KV "
                         "group (rollout/pd/kv_group.py), a part of relayrl_decode_kv_transfer_bytes_total")
KV_REFUSED = Counter("relayrl_decode_kv_transfers_refused_total", "KV transfers refused", ["reason"])
_RETRY_S = 0.02  # pause before asking again for blocks, or (doubling) for a prefill under the served weights
_RETRY_MAX_S = 2.0  # the longest pause between two pulls of one prefill

_CODES = (
    (KVTransferInvalid, grpc.StatusCode.INVALID_ARGUMENT),
    (KVTransferCorrupt, grpc.StatusCode.DATA_LOSS),
    (KVWeightVersionMismatch, grpc.StatusCode.FAILED_PRECONDITION),
    *REFUSAL_CODES,
)

_REFUSALS = tuple(kind for kind, _ in _CODES)


class Config(Strict):
    """`relayrl serve decode` configuration."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    model: str = Field(description="Local Hugging Face model folder (the prefill workers' model).")
    engine: NativeSettings = Field(default_factory=NativeSettings)
    prefill: list[str] = Field(min_length=1, description="host:port of each prefill worker (taken in turn).")
    prefill_client: ClientConfig = Field(default_factory=ClientConfig, description="How to reach prefill workers.")
    codec: Literal["none", "int8", "int4"] | None = Field(None, description="Wire codec asked of the prefill workers; "
                                                          "None: each prefill worker's own setting.")
    import_wait_s: float = Field(30.0, gt=0, description="How long a request waits for KV blocks, or for a prefill "
                                 "under the weights served here, before RESOURCE_EXHAUSTED / FAILED_PRECONDITION.")
    max_repulls: int = Field(10, ge=0, description="How many times a request pulls its prefill again while the "
                             "prefill workers send KV of older weights than served here (pauses doubling from 20 ms "
                             "to 2 s); then FAILED_PRECONDITION. Bounds the bytes shipped again per request.")
    prefill_timeout_s: float = Field(60.0, gt=0, description="Deadline of one Prefill call.")
    kv_group: KVGroupConfig | None = Field(None, description="A torch.distributed group shared with prefill "
                                           "workers: their payloads come by recv, not gRPC chunks, once the group "
                                           "is up (rollout/pd/kv_group.py). None = gRPC only.")
    images: ImageSettings = Field(default_factory=ImageSettings, description="Limits on a request's images (a "
                                  "vision-language model; rollout/serve/images.py).")


def params_proto(params: SamplingParams) -> rollout_pb2.SamplingParams:
    """SamplingParams as the wire carries them (RolloutServicer._params' inverse)."""
    msg = rollout_pb2.SamplingParams(
        temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, max_tokens=params.max_tokens,
        stop_token_ids=params.stop_token_ids, stop=params.stop, n=params.n, ignore_eos=params.ignore_eos)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


class DecodeServicer(RolloutServicer):
    def __init__(self, engine: "AsyncEngine", model_name: str, tokenizer, prefill_channels: list[grpc.aio.Channel],
                 codec: str | None = None, import_wait_s: float = 30.0, prefill_timeout_s: float = 60.0,
                 group: KVGroup | None = None, max_repulls: int = 10, images: "ImageReader | None" = None):
        super().__init__(engine, model_name, tokenizer, images=images)
        self.group = group
        self._tags = itertools.count(1)
        self.prefill_stubs = [kv_pb2_grpc.PrefillWorkerStub(channel) for channel in prefill_channels]
        # Over an NCCL group, one grouped transfer in flight per prefill worker (KVGroup.one_at_a_time).
        self._grouped_turn = {id(stub): asyncio.Lock() for stub in self.prefill_stubs}
        self._next_prefill = itertools.cycle(range(len(self.prefill_stubs)))
        self.codec = codec or ""
        self.import_wait_s = import_wait_s
        self.prefill_timeout_s = prefill_timeout_s
        self.max_repulls = max_repulls

    async def _generate(self, request_id: str, prompt: list[int], params: SamplingParams,
                        context, images: list["ReadImage"] = ()) -> AsyncIterator[Completion]:
        """Pull the prefill (with the prompt's images, as read), import it, stream the deltas; refusals end the call
        with their status."""
        from rollout.engine.errors import EngineDead

        request = rollout_pb2.GenerateRequest(request_id=request_id, prompt_ids=encode_array(prompt, "int32"),
                                              params=params_proto(params), images=[
                                                  rollout_pb2.ImagePart(data=read.image.data, media_type=read.media_type,
                                                                        sha256=read.image.hash) for read in images])
        started = time.monotonic()
        deadline = started + self.import_wait_s
        pulls, shipped, pause, pulled = 0, 0, _RETRY_S, None
        try:
            while True:
                if pulled is None:
                    pulled = await self._pull(request, context)
                    pulls += 1
                    shipped += sum(c.header.payload_bytes if c.HasField("header") else 0 for c in pulled[0][:1])
                try:
                    transfer = await asyncio.to_thread(self._unpack, *pulled)
                    async for delta in self._import(transfer, deadline, [read.image for read in images]):
                        yield delta
                    return
                except KVWeightVersionMismatch as exc:
                    served, left = self.engine.weight_version, deadline - time.monotonic()
                    if exc.kv_version is not None and exc.kv_version > served and left > 0:
                        await self.engine.watch_version(served, left)  # this worker's weights are the older ones
                        continue  # the same transfer, not pulled again
                    if pulls > self.max_repulls or left < pause:
                        raise KVWeightVersionMismatch(
                            f"weight_version: {pulls} pulls of the prefill ({shipped} bytes) in "
                            f"{time.monotonic() - started:.1f}s brought KV of weights version {exc.kv_version}, this "
                            f"worker serves {served} (max_repulls {self.max_repulls}, import_wait_s "
                            f"{self.import_wait_s})", exc.kv_version, served) from exc
                    await asyncio.sleep(pause)  # the prefill worker's weights are older: pull again
                    pause, pulled = min(2 * pause, _RETRY_MAX_S), None
        except (*_REFUSALS, EngineDead) as exc:  # EngineDead: UNAVAILABLE
            await self._refuse(context, exc)

    async def _generate_all(self, request_id: str, prompt: list[int], params: SamplingParams,
                            context, images: list["ReadImage"] = ()) -> list[Completion]:
        completions = [Completion(i) for i in range(params.n)]
        async for delta in self._generate(request_id, prompt, params, context, images):
            done = completions[delta.index]
            done.token_ids += delta.token_ids
            done.logprobs += delta.logprobs
            done.weight_versions += delta.weight_versions
            done.finish_reason, done.kv_version = delta.finish_reason, delta.kv_version
            done.routed_experts = delta.routed_experts  # None: the imported KV brought no routes
        return completions

    async def Continue(self, request_iterator, context) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        from rollout.engine.errors import EngineDead

        chunks = [chunk async for chunk in request_iterator]
        try:
            transfer = await asyncio.to_thread(self._unpack, chunks)
            request = transfer.request
            images = [read.image for read in await asyncio.to_thread(self._read_images, request.images)]
            async for delta in self._import(transfer, time.monotonic() + self.import_wait_s, images):
                yield generate_chunk(request.request_id, delta, request.params.logprobs,
                                     self.decode_text(delta.token_ids))
        except (*_REFUSALS, EngineDead) as exc:  # EngineDead: UNAVAILABLE
            await self._refuse(context, exc)

    def _unpack(self, chunks: list[kv_pb2.KVTransferChunk], payload: "torch.Tensor | None" = None) -> "ReceivedTransfer":
        """The checked, decoded transfer (rollout/pd/transfer.py's unpack); seconds for a large one: run it in a thread."""
        from rollout.engine.kv_handoff import served_layout
        from rollout.pd.transfer import unpack

        transfer = unpack(chunks, served_layout(self.engine.engine), payload)
        KV_BYTES.inc(transfer.payload_bytes)
        return transfer

    async def _pull(self, request: rollout_pb2.GenerateRequest,
                    context) -> tuple[list[kv_pb2.KVTransferChunk], "torch.Tensor | None"]:
        """The request's prefill from the next prefill worker that answers (UNAVAILABLE when none does): its chunks,
        and the payload when it came over the KV group (a uint8 tensor on the group's device)."""
        last_error = None
        for _ in range(len(self.prefill_stubs)):
            stub = self.prefill_stubs[next(self._next_prefill)]
            try:
                pulled = await self._prefill_chunks(stub, request)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    await context.abort(exc.code(), f"prefill: {exc.details()}")
                last_error = exc
                continue
            except KVGroupError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill: {exc}")
            return pulled
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"no prefill worker answers: {last_error.details()}")

    async def _prefill_chunks(self, stub, request: rollout_pb2.GenerateRequest
                              ) -> tuple[list[kv_pb2.KVTransferChunk], "torch.Tensor | None"]:
        """One Prefill call's transfer; with the KV group up, its payload comes by recv."""
        ask = kv_pb2.PrefillRequest(request=request, codec=self.codec)
        if self.group is not None and self.group.ready:
            ask.kv_group_rank = self.group.rank
            ask.kv_group_tag = next(self._tags) % (1 << 31)
            if self.group.one_at_a_time:
                async with self._grouped_turn[id(stub)]:
                    return await self._stream_prefill(stub, ask)
        return await self._stream_prefill(stub, ask)

    async def _stream_prefill(self, stub, ask: kv_pb2.PrefillRequest
                              ) -> tuple[list[kv_pb2.KVTransferChunk], "torch.Tensor | None"]:
        """The chunks of `ask`'s Prefill call, and the payload received over the group when the header says so."""
        from rollout.engine.kv_handoff import served_layout
        from rollout.pd.transfer import check_header

        chunks, received = [], None
        async for chunk in stub.Prefill(ask, timeout=self.prefill_timeout_s):
            chunks.append(chunk)
            if chunk.WhichOneof("kind") == "header" and chunk.header.HasField("payload_from_rank"):
                header = chunk.header
                if not ask.HasField("kv_group_rank"):
                    raise KVTransferInvalid("payload_from_rank: the payload was sent over a KV group this worker "
                                            "did not ask for")
                check_header(header, served_layout(self.engine.engine))  # before allocating payload_bytes
                received = asyncio.create_task(asyncio.to_thread(
                    self.group.recv, header.payload_bytes, header.payload_from_rank, ask.kv_group_tag))
        if received is None:
            return chunks, None
        payload = await received
        KV_GROUP_BYTES.inc(payload.numel())
        return chunks, payload

    async def _import(self, transfer: "ReceivedTransfer", deadline: float, images=()) -> AsyncIterator[Completion]:
        """The deltas of the imported request (`images`: its prompt's, ImageInputs); waits (until `deadline`) while its
        KV blocks are not free."""
        params = dataclasses.replace(self._params(transfer.request.params), seed=transfer.prefilled.seed)
        while True:
            try:
                async for delta in self.engine.generate_prefilled(transfer.request.request_id, transfer.prefilled,
                                                                  params, images):
                    yield delta
                return
            except QueueFull:  # raised before any delta: the blocks are taken now
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(_RETRY_S)

    async def _refuse(self, context, exc: Exception) -> None:
        code = next((code for kind, code in _CODES if isinstance(exc, kind)), grpc.StatusCode.UNAVAILABLE)
        if isinstance(exc, (KVTransferInvalid, KVTransferCorrupt, KVWeightVersionMismatch)):
            KV_REFUSED.labels(type(exc).__name__).inc()
            log.warning("KV transfer refused (%s): %s", code.name, exc)
        await context.abort(code, str(exc))


class DecodeWorkerRPCs(kv_pb2_grpc.DecodeWorkerServicer):
    """relayrl.kv.v1.DecodeWorker over a DecodeServicer: Continue, and Rollout.GetLoad in kv's message."""

    def __init__(self, servicer: DecodeServicer):
        self.servicer = servicer

    async def Continue(self, request_iterator, context) -> AsyncIterator[rollout_pb2.GenerateChunk]:
        async for chunk in self.servicer.Continue(request_iterator, context):
            yield chunk

    async def GetLoad(self, request, context) -> kv_pb2.GetLoadResponse:
        load = await self.servicer.GetLoad(rollout_pb2.GetLoadRequest(), context)
        return kv_pb2.GetLoadResponse(free_blocks=load.free_blocks, num_blocks=load.num_blocks, running=load.running,
                                      waiting=load.waiting, weight_version=load.weight_version)


async def serve(config: Config) -> None:
    """Load the model and serve Rollout + DecodeWorker (+ WeightSync) until SIGTERM."""
    from protos import rollout_pb2_grpc, weights_pb2_grpc
    from rollout.engines import start_engine
    from rollout.serve.images import ImageReader
    from rollout.serve.weight_receiver import WeightReceiver
    from rollout.serve.wire import SERVICE_NAME as ROLLOUT_SERVICE
    from services.client import connect
    from services.runtime import serve as serve_forever


    engine = start_engine(config.model, config.engine)
    channels = [connect(address, config.prefill_client) for address in config.prefill]
    servicer = DecodeServicer(engine, config.model, engine.tokenizer, channels, config.codec,
                              config.import_wait_s, config.prefill_timeout_s,
                              KVGroup(config.kv_group, engine.device) if config.kv_group else None,
                              config.max_repulls, ImageReader.for_model(config.model, config.images))

    async def on_stop() -> None:
        engine.shutdown()
        for channel in channels:
            await channel.close()

    await serve_forever("decode", [
        (rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, ROLLOUT_SERVICE),
        (kv_pb2_grpc.add_DecodeWorkerServicer_to_server, DecodeWorkerRPCs(servicer), SERVICE_NAME),
        (weights_pb2_grpc.add_WeightSyncServicer_to_server, WeightReceiver(engine), "relayrl.weights.v1.WeightSync"),
    ], config.server, on_stop)
