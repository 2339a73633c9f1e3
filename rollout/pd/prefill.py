"""The prefill worker: `relayrl serve prefill --model PATH`.

Prefill/decode disaggregation, as built here (rollout/pd/decode.py, rollout/router/router.py):

    client -> rollout router --Generate--> decode worker --Prefill--> prefill worker
                  (by load,                    |  <--KV transfer (header + payload chunks)--
                   key affinity)               v
                                  import the KV, decode, stream tokens back (Rollout messages)

The router forwards a Generate to a decode worker chosen by load (or by its routing key's affinity); the
decode worker pulls the prefill from a prefill worker over a server-streamed KV transfer (rollout/pd/transfer.py,
compressed by the configured codec), validates it, imports it and decodes. The decode worker pulls, rather
than the prefill worker pushing, so a generation is one call chain that a dead hop fails as a whole: the
router re-runs it elsewhere, and no half-delivered KV waits anywhere for a caller that is gone. Workers that
share a torch.distributed group (`kv_group`) send the payload over it and only the header over gRPC
(rollout/pd/kv_group.py).

This worker holds no sequence between calls: each Prefill runs between two engine steps (kv_handoff.py),
prefills the n completions of the prompt once and frees its blocks. It receives weight updates like a rollout
worker (WeightSync), and the transfer carries the version the KV was computed with.

A prompt with images (a vision-language model) is read here as the rollout service reads it (rollout/serve/images.py:
decoded, checked, processed, its one-token image runs expanded); the vision tower runs in this worker's prefill, and
the transfer carries the prompt's M-RoPE positions with the images as data parts (rollout/pd/transfer.py), which the
decode worker needs to continue the positions and, should it preempt the request, to recompute the prompt.
"""

import asyncio
import uuid
from typing import TYPE_CHECKING, Literal

import grpc
from pydantic import Field

from protos import kv_pb2, kv_pb2_grpc
from protos.codec import CodecError, decode_array
from rollout.engine.errors import DuplicateRequest, InvalidRequest, QueueFull
from rollout.engines.settings import NativeSettings
from rollout.kv.codecs import CODECS
from rollout.pd.kv_group import KVGroup, KVGroupConfig, KVGroupError
from rollout.serve.config import ImageSettings
from rollout.serve.service import RolloutServicer
from services.config import ServerConfig, Strict

if TYPE_CHECKING:
    import torch

    from protos import rollout_pb2
    from rollout.engine.async_engine import AsyncEngine
    from rollout.kv.prefilled import PrefilledPrompt
    from rollout.serve.images import ImageReader, ReadImage

SERVICE_NAME = "relayrl.kv.v1.PrefillWorker"
_CHUNK_BYTES = 1 << 20  # rollout.pd.transfer.DEFAULT_CHUNK_BYTES (not imported here: it pulls in torch)


class Config(Strict):
    """`relayrl serve prefill` configuration."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    model: str = Field(description="Local Hugging Face model folder (the decode workers' model).")
    engine: NativeSettings = Field(default_factory=NativeSettings)
    codec: Literal["none", "int8", "int4"] = Field("none", description="Wire codec of the KV when a Prefill names "
                                                   "none (rollout/kv/codecs.py).")
    chunk_bytes: int = Field(_CHUNK_BYTES, gt=0, description="Largest payload piece of a KV transfer message.")
    kv_group: KVGroupConfig | None = Field(None, description="A torch.distributed group shared with decode "
                                             "workers: payloads to its members go by send, not gRPC chunks "
                                             "(rollout/pd/kv_group.py). None = gRPC only.")
    images: ImageSettings = Field(default_factory=ImageSettings, description="Limits on a request's images (a "
                                  "vision-language model; rollout/serve/images.py).")


class PrefillServicer(kv_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, engine: "AsyncEngine", tokenizer, codec: str = "none", chunk_bytes: int = _CHUNK_BYTES,
                 group: KVGroup | None = None, images: "ImageReader | None" = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.codec = codec
        self.chunk_bytes = chunk_bytes
        self.group = group
        self.images = images  # reads a request's image parts (a vision-language model); None: text only

    async def Prefill(self, request: kv_pb2.PrefillRequest, context):
        from rollout.engine.errors import EngineDead

        generate = request.request
        codec = request.codec or self.codec
        if codec not in CODECS:
            raise CodecError(f"codec: {codec!r} is not one of {CODECS}")
        prompt_ids = decode_array(generate.prompt_ids, field="request.prompt_ids", expect="int32")
        if prompt_ids.size and generate.prompt_text:
            raise CodecError("request.prompt_ids: give prompt_ids or prompt_text, not both")
        prompt = self.tokenizer(generate.prompt_text).input_ids if generate.prompt_text else prompt_ids.tolist()
        images = self._read_images(generate.images)
        if images:
            prompt = self.images.expand(prompt, images)
            generate = _with_image_data(generate, images)
        request_id = generate.request_id or uuid.uuid4().hex
        params = RolloutServicer._params(generate.params)
        try:
            prefilled = await self.engine.prefill_for_transfer(request_id, prompt, params,
                                                               [read.image for read in images])
        except (InvalidRequest, QueueFull, DuplicateRequest, EngineDead) as exc:
            await context.abort(_code(exc), str(exc))
        grouped = request.HasField("kv_group_rank") and self.group is not None and self.group.ready
        to_rank = request.kv_group_rank if grouped else None
        # encoding, the copy to the host and the CRC-32 take milliseconds per megabyte: not on the event loop
        chunks, payload = await asyncio.to_thread(self._transfer, generate, prefilled, codec, to_rank is not None)
        for chunk in chunks:
            yield chunk
        if to_rank is not None:  # the decode worker posts its recv when the header arrives
            try:
                await asyncio.to_thread(self.group.send, payload, to_rank, request.kv_group_tag)
            except KVGroupError as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def _read_images(self, parts) -> list["ReadImage"]:
        """A request's image parts read (CodecError, INVALID_ARGUMENT, names a bad one); [] without parts."""
        if not parts:
            return []
        if self.images is None:
            raise CodecError("request.images: this prefill worker serves a text-only model: it takes no images")
        return self.images.read(list(parts))

    def _transfer(self, request: "rollout_pb2.GenerateRequest", prefilled: "PrefilledPrompt", codec: str,
                  grouped: bool) -> tuple[list[kv_pb2.KVTransferChunk], "torch.Tensor | None"]:
        """The transfer's chunks, and with `grouped` the payload the group sends (encoded on the engine's device, moved
        to the group's: a gloo group's is on the host, an NCCL group's stays on the GPU)."""
        from rollout.pd.transfer import encode_payload, pack

        payload = encode_payload(prefilled, codec)
        if not grouped:
            return list(pack(request, prefilled, codec, self.chunk_bytes, payload)), None
        payload = payload.to(self.group.device)
        return list(pack(request, prefilled, codec, self.chunk_bytes, payload, self.group.rank)), payload


def _with_image_data(request: "rollout_pb2.GenerateRequest", images: list["ReadImage"]) -> "rollout_pb2.GenerateRequest":
    """`request` with its image parts as the bytes read (a uri part read here is not read again by the decode
    worker), each with its hash and media type."""
    from protos import rollout_pb2

    sent = rollout_pb2.GenerateRequest()
    sent.CopyFrom(request)
    del sent.images[:]
    sent.images.extend(rollout_pb2.ImagePart(data=read.image.data, media_type=read.media_type, sha256=read.image.hash)
                       for read in images)
    return sent


def _code(exc: Exception) -> grpc.StatusCode:
    for kind, code in ((InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT), (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
                       (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS)):
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.UNAVAILABLE


async def serve(config: Config) -> None:
    """Load the model and serve PrefillWorker (+ WeightSync) until SIGTERM."""
    from protos import weights_pb2_grpc
    from rollout.engines import start_engine
    from rollout.serve.images import ImageReader
    from rollout.serve.weight_receiver import WeightReceiver
    from services.runtime import serve as serve_forever

    engine = start_engine(config.model, config.engine)
    group = KVGroup(config.kv_group, engine.device) if config.kv_group else None
    servicer = PrefillServicer(engine, engine.tokenizer, config.codec, config.chunk_bytes, group,
                               ImageReader.for_model(config.model, config.images))

    async def on_stop() -> None:
        engine.shutdown()

    await serve_forever("prefill", [
        (kv_pb2_grpc.add_PrefillWorkerServicer_to_server, servicer, SERVICE_NAME),
        (weights_pb2_grpc.add_WeightSyncServicer_to_server, WeightReceiver(engine), "relayrl.weights.v1.WeightSync"),
    ], config.server, on_stop)
