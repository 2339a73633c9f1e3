"""The KV transfer: a prefilled prompt on the wire, from a prefill worker to a decode worker.

A transfer is a stream of KVTransferChunk (protos/kv.proto): one header (the request with the seed its
first tokens were sampled with, the KV layout and dtype, the codec, the weight version, the payload's byte
count and CRC-32, the first token of each completion with its logprob, and for a prompt with images its M-RoPE
positions and the offset decoding continues them with), then the encoded KV payload
in pieces of at most `chunk_bytes`. `unpack` checks everything against what the receiving engine serves
and raises the typed errors of rollout/engine/errors.py, which the servicer maps to status codes.

The payload is encoded where the KV is (the engine's device) into one uint8 buffer (`encode_payload`); it goes to
the host only for gRPC chunks (one copy), or as the buffer it is over a KV group (rollout/pd/kv_group.py). The
CRC-32 is of the payload's host bytes: a payload that stays on a GPU (an NCCL group) carries none (checksum 0, not
checked: NCCL delivers a buffer whole or fails the op). Encoding, decoding and checksums cost milliseconds per
megabyte: the workers run them off their event loop (rollout/pd/prefill.py, rollout/pd/decode.py).
"""

import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from protos import kv_pb2, rollout_pb2
from protos.codec import CodecError, decode_array, encode_array
from rollout.config import DTYPES
from rollout.engine.errors import KVTransferCorrupt, KVTransferInvalid, KVWeightVersionMismatch
from rollout.kv.codecs import CODECS, make_codec
from rollout.kv.prefilled import PrefilledPrompt, ServedLayout

DEFAULT_CHUNK_BYTES = 1 << 20  # well under gRPC's default 4 MiB message limit
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


@dataclass
class ReceivedTransfer:
    request: rollout_pb2.GenerateRequest  # prompt_ids set, params.seed set
    prefilled: PrefilledPrompt
    codec: str
    payload_bytes: int  # bytes of the encoded KV as they travelled


def encode_payload(prefilled: PrefilledPrompt, codec: str) -> torch.Tensor:
    """The KV of `prefilled` encoded by `codec`, as a transfer carries it: one uint8 tensor on the KV's device."""
    return make_codec(codec).encode(prefilled.keys, prefilled.values).to_buffer()


def checksum(payload: bytes | torch.Tensor) -> int:
    """CRC-32 of a payload on the host (a tensor's memory read in place); 0 for one on a device (never copied)."""
    if isinstance(payload, torch.Tensor):
        return zlib.crc32(payload.numpy()) if payload.device.type == "cpu" else 0
    return zlib.crc32(payload)


def pack(request: rollout_pb2.GenerateRequest, prefilled: PrefilledPrompt, codec: str,
         chunk_bytes: int = DEFAULT_CHUNK_BYTES, payload: bytes | torch.Tensor | None = None,
         payload_from_rank: int | None = None) -> Iterator[kv_pb2.KVTransferChunk]:
    """The chunks of a transfer of `prefilled` for `request` (its prompt and seed are taken from `prefilled`).
    `payload`: encode_payload's buffer or its host bytes (None: encoded here). With `payload_from_rank` the header
    alone: the payload goes over the KV group as the buffer it is (rollout/pd/kv_group.py)."""
    if payload is None:
        payload = encode_payload(prefilled, codec)
    if isinstance(payload, torch.Tensor) and payload_from_rank is None:
        payload = payload.cpu().numpy().tobytes()
    nbytes = payload.numel() if isinstance(payload, torch.Tensor) else len(payload)
    layers, tokens, heads, head_dim = prefilled.keys.shape
    sent = rollout_pb2.GenerateRequest()
    sent.CopyFrom(request)
    sent.prompt_text = ""
    sent.prompt_ids.CopyFrom(encode_array(prefilled.prompt_ids, "int32"))
    sent.params.seed = prefilled.seed
    header = kv_pb2.KVTransferHeader(
        request=sent,
        layout=kv_pb2.KVLayout(num_layers=layers, num_tokens=tokens, num_kv_heads=heads, head_dim=head_dim,
                               dtype=_DTYPE_NAMES[prefilled.keys.dtype]),
        codec=codec,
        weight_version=prefilled.weight_version,
        payload_bytes=nbytes,
        checksum=checksum(payload),
        first_token_ids=encode_array(prefilled.first_token_ids, "int32"),
        first_logprobs=encode_array(prefilled.first_logprobs, "float32"),
        payload_from_rank=payload_from_rank,
    )
    if prefilled.mrope_positions is not None:
        header.mrope_positions.CopyFrom(encode_array(prefilled.mrope_positions.reshape(-1).numpy(), "int32"))
        header.mrope_delta = prefilled.rope_delta
    yield kv_pb2.KVTransferChunk(header=header)
    if payload_from_rank is not None:
        return
    view = memoryview(payload)
    for start in range(0, len(payload), chunk_bytes):
        yield kv_pb2.KVTransferChunk(payload=bytes(view[start : start + chunk_bytes]))


def unpack(chunks: Iterable[kv_pb2.KVTransferChunk], served: ServedLayout,
           payload: torch.Tensor | None = None) -> ReceivedTransfer:
    """Check a whole transfer against `served` and decode it. `payload`: what came over the KV group for a header
    with payload_from_rank (a uint8 tensor; the KV is decoded on its device), else None (payload chunks). Raises
    KVTransferInvalid (layout, shape, dtype, codec, chunk order), KVTransferCorrupt (length, checksum),
    KVWeightVersionMismatch."""
    header: kv_pb2.KVTransferHeader | None = None
    pieces: list[bytes] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.WhichOneof("kind")
        if (kind == "header") != (i == 0):
            raise KVTransferInvalid(f"chunk {i}: a transfer is one header chunk, then payload chunks (got {kind})")
        if kind == "header":
            header = chunk.header
        else:
            pieces.append(chunk.payload)
    if header is None:
        raise KVTransferInvalid("the transfer is empty: it has no header")
    layout = check_header(header, served)
    positions = decode_array(header.mrope_positions, expect="int32")
    if payload is None:
        payload = torch.frombuffer(bytearray().join(pieces), dtype=torch.uint8) if any(pieces) else torch.empty(
            0, dtype=torch.uint8)
    elif pieces:
        raise KVTransferInvalid("payload: the transfer has payload chunks and a payload from the KV group")
    if payload.numel() != header.payload_bytes:
        raise KVTransferCorrupt(f"payload: {payload.numel()} bytes arrived, the header announced {header.payload_bytes}")
    crc = checksum(payload)
    if payload.device.type == "cpu" and crc != header.checksum:
        raise KVTransferCorrupt(f"payload: CRC-32 {crc:#010x} does not match the header's {header.checksum:#010x}")
    if header.weight_version != served.weight_version:
        raise KVWeightVersionMismatch(f"weight_version: the KV was computed with weights version "
                                      f"{header.weight_version}, this worker serves {served.weight_version}",
                                      header.weight_version, served.weight_version)
    codec = make_codec(header.codec)
    keys, values = codec.decode(codec.from_buffer(layout, served.dtype, payload))
    request = header.request
    prompt = decode_array(request.prompt_ids, field="header.request.prompt_ids", expect="int32").tolist()
    prefilled = PrefilledPrompt(
        prompt_ids=prompt, keys=keys, values=values,
        first_token_ids=decode_array(header.first_token_ids, expect="int32").tolist(),
        first_logprobs=decode_array(header.first_logprobs, expect="float32").tolist(),
        seed=request.params.seed, weight_version=header.weight_version,
        mrope_positions=torch.from_numpy(positions.astype("int64")).reshape(3, -1) if positions.size else None,
        rope_delta=header.mrope_delta,
    )
    return ReceivedTransfer(request, prefilled, header.codec, payload.numel())


def check_header(header: kv_pb2.KVTransferHeader, served: ServedLayout) -> tuple[int, int, int, int]:
    """The KV shape a header announces, once it is checked against `served` (raises as unpack does)."""
    layout = header.layout
    expected = (served.num_layers, served.num_kv_heads, served.head_dim)
    if (layout.num_layers, layout.num_kv_heads, layout.head_dim) != expected:
        raise KVTransferInvalid(
            f"layout: the transfer has {layout.num_layers} layers x {layout.num_kv_heads} kv heads x head_dim "
            f"{layout.head_dim}, this worker's model {expected[0]} x {expected[1]} x {expected[2]}")
    if DTYPES.get(layout.dtype) is not served.dtype:
        raise KVTransferInvalid(f"layout.dtype: the transfer holds {layout.dtype!r} KV, this worker's cache is "
                                f"{_DTYPE_NAMES[served.dtype]!r}")
    if header.codec not in CODECS:
        raise KVTransferInvalid(f"codec: {header.codec!r} is not one of {CODECS}")
    request = header.request
    try:
        prompt = decode_array(request.prompt_ids, field="header.request.prompt_ids", expect="int32")
        first_ids = decode_array(header.first_token_ids, field="header.first_token_ids", expect="int32")
        first_logprobs = decode_array(header.first_logprobs, field="header.first_logprobs", expect="float32")
        positions = decode_array(header.mrope_positions, field="header.mrope_positions", expect="int32")
    except CodecError as exc:
        raise KVTransferInvalid(str(exc)) from None
    if prompt.size == 0 or layout.num_tokens != prompt.size:
        raise KVTransferInvalid(f"layout.num_tokens: {layout.num_tokens} tokens of KV for a prompt of {prompt.size}")
    if positions.size not in (0, 3 * prompt.size):
        raise KVTransferInvalid(f"mrope_positions: {positions.size} positions for a prompt of {prompt.size} tokens "
                                f"(3 per token, or none)")
    n = request.params.n or 1
    if first_ids.size != n or first_logprobs.size != n:
        raise KVTransferInvalid(f"first_token_ids: one per completion (n={n}), got {first_ids.size} ids and "
                                f"{first_logprobs.size} logprobs")
    if first_ids.size and not (0 <= first_ids.min() and first_ids.max() < served.vocab_size):
        raise KVTransferInvalid(f"first_token_ids: ids outside the vocabulary [0, {served.vocab_size})")
    if not request.params.HasField("seed"):
        raise KVTransferInvalid("header.request.params.seed: a transfer carries the seed its first tokens used")
    shape = (layout.num_layers, layout.num_tokens, layout.num_kv_heads, layout.head_dim)
    try:
        encoded = make_codec(header.codec).encoded_nbytes(shape, served.dtype)
    except ValueError as exc:  # a layout the codec cannot encode (int4 with an odd head_dim)
        raise KVTransferInvalid(str(exc)) from None
    if header.payload_bytes != encoded:
        raise KVTransferInvalid(f"payload_bytes: the header announces {header.payload_bytes}, the {header.codec} "
                                f"encoding of {list(shape)} {layout.dtype} is {encoded} bytes")
    return shape
