"""How the Buffer service meets the wire.

Departures from the generated `add_BufferServicer_to_server`, same method names and messages:

- Requests are decoded leniently: bytes that do not parse reach the handler as `Undecodable`, which
  it answers with INVALID_ARGUMENT (grpc's own decoder failure is an UNKNOWN status and a logged
  traceback, not a clear error).
- A PutRequest is only split into its samples' bytes (`PutPayload`): the buffer stores each sample
  exactly as the producer serialized it, with no re-encoding.
- A Batch is encoded straight from the stored sample bytes: the samples are never parsed and
  re-serialized on their way out (measured ~120-160 us per sample of 1k-8k tokens otherwise).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from protos import buffer_pb2
from protos.codec import CodecError
from services.buffer.results import LeasedBatch

SERVICE_NAME = buffer_pb2.DESCRIPTOR.services_by_name["Buffer"].full_name


@dataclass(frozen=True)
class Undecodable:
    """Request bytes that are not a valid message of the expected type."""

    reason: str


def decoder(cls: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def decode(data: bytes) -> Message | Undecodable:
        try:
            return cls.FromString(data)
        except DecodeError as exc:
            return Undecodable(f"request is not a valid {cls.DESCRIPTOR.full_name}: {exc}")

    return decode


@dataclass(frozen=True)
class PutPayload:
    """A PutRequest as its samples' serialized bytes (views into the request)."""

    samples: list[memoryview]


class _WireError(ValueError):
    pass


def _read_varint(data: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _WireError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


_SAMPLES_FIELD = buffer_pb2.PutRequest.DESCRIPTOR.fields_by_name["samples"].number


def decode_put(data: bytes) -> PutPayload | Undecodable:
    """Split a serialized PutRequest into its samples' bytes without decoding them (the buffer
    validates each one); unknown fields are skipped as protobuf would."""
    view, pos, samples = memoryview(data), 0, []
    try:
        while pos < len(view):
            key, pos = _read_varint(view, pos)
            field, wire_type = key >> 3, key & 7
            if field == 0:
                raise _WireError("field number 0")
            if wire_type == 0:
                _, pos = _read_varint(view, pos)
            elif wire_type == 1 or wire_type == 5:
                pos += 8 if wire_type == 1 else 4
            elif wire_type == 2:
                length, pos = _read_varint(view, pos)
                if field == _SAMPLES_FIELD:
                    samples.append(view[pos : pos + length])
                pos += length
            else:
                raise _WireError(f"unsupported wire type {wire_type}")
            if pos > len(view):
                raise _WireError("a field runs past the end")
    except _WireError as exc:
        return Undecodable(f"request is not a valid relayrl.buffer.v1.PutRequest: {exc}")
    return PutPayload(samples)


def require(request: Any) -> Any:
    """The decoded request, or CodecError (INVALID_ARGUMENT) if its bytes did not parse."""
    if isinstance(request, Undecodable):
        raise CodecError(request.reason)
    return request


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64s are ten-byte two's complement on the wire
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


_LEASE_ID_TAG = b"\x0a"  # field 1, length-delimited
_SAMPLE_TAG = b"\x12"  # field 2, length-delimited
_VERSION_TAG = b"\x18"  # field 3, varint


def encode_batch(batch: LeasedBatch) -> bytes:
    """The wire form of buffer_pb2.Batch for `batch`, built from the stored sample bytes."""
    lease_id = batch.lease_id.encode()
    parts = [_LEASE_ID_TAG, _varint(len(lease_id)), lease_id]
    for payload in batch.payloads:
        parts += (_SAMPLE_TAG, _varint(len(payload)), payload)
    if batch.trainer_version:
        parts += (_VERSION_TAG, _varint(batch.trainer_version))
    return b"".join(parts)


def add_buffer_to_server(servicer: Any, server: grpc.aio.Server) -> None:
    """Register `servicer` (a BufferServicer) on `server`."""
    handlers = {
        "Put": grpc.unary_unary_rpc_method_handler(
            servicer.Put, decode_put, buffer_pb2.PutResponse.SerializeToString),
        "PutStream": grpc.stream_unary_rpc_method_handler(
            servicer.PutStream, decode_put, buffer_pb2.PutResponse.SerializeToString),
        "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull, decoder(buffer_pb2.PullRequest), encode_batch),
        "Ack": grpc.unary_unary_rpc_method_handler(
            servicer.Ack, decoder(buffer_pb2.AckRequest), buffer_pb2.AckResponse.SerializeToString),
        "ExtendLease": grpc.unary_unary_rpc_method_handler(
            servicer.ExtendLease, decoder(buffer_pb2.ExtendLeaseRequest),
            buffer_pb2.ExtendLeaseResponse.SerializeToString),
        "SetVersion": grpc.unary_unary_rpc_method_handler(
            servicer.SetVersion, decoder(buffer_pb2.SetVersionRequest),
            buffer_pb2.SetVersionResponse.SerializeToString),
        "Stats": grpc.unary_unary_rpc_method_handler(
            servicer.Stats, decoder(buffer_pb2.StatsRequest), buffer_pb2.StatsResponse.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
