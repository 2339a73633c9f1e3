"""Bulk payloads on the wire: numpy arrays as raw little-endian bytes (1-D, or shaped: encode_tensor), metadata as
msgpack."""

import functools
from typing import Any

import msgpack
import numpy as np

from protos import common_pb2

_DTYPES: dict[int, np.dtype] = {
    common_pb2.DTYPE_INT32: np.dtype("<i4"),
    common_pb2.DTYPE_INT64: np.dtype("<i8"),
    common_pb2.DTYPE_FLOAT32: np.dtype("<f4"),
    common_pb2.DTYPE_FLOAT16: np.dtype("<f2"),
    common_pb2.DTYPE_UINT8: np.dtype("u1"),
    common_pb2.DTYPE_FLOAT64: np.dtype("<f8"),
    common_pb2.DTYPE_UINT16: np.dtype("<u2"),
}
_CODES: dict[str, int] = {dt.str.lstrip("<|"): code for code, dt in _DTYPES.items()}
# bfloat16 has no numpy type: it travels as uint16 bit patterns (see torch_dtype helpers).
_BF16_ITEMSIZE = 2


class CodecError(ValueError):
    """A payload on the wire is malformed (wrong length, unknown dtype, bad msgpack)."""


@functools.lru_cache(maxsize=64)  # numpy's dtype name handling costs more than encoding a short array
def dtype_code(dtype: np.dtype | str) -> int:
    """The wire DType for a numpy dtype (or its name, e.g. 'float32', 'bfloat16')."""
    if str(dtype) == "bfloat16":
        return common_pb2.DTYPE_BFLOAT16
    key = np.dtype(dtype).newbyteorder("<").str.lstrip("<|")
    if key not in _CODES:
        raise CodecError(f"dtype {dtype} cannot travel on the wire")
    return _CODES[key]


def itemsize(code: int) -> int:
    """Bytes per element of a wire DType."""
    if code == common_pb2.DTYPE_BFLOAT16:
        return _BF16_ITEMSIZE
    if code not in _DTYPES:
        raise CodecError(f"unknown dtype code {code}")
    return _DTYPES[code].itemsize


def encode_array(values: Any, dtype: np.dtype | str) -> common_pb2.Array:
    """Encode a 1-D sequence or array as a wire Array of `dtype`."""
    arr = np.ascontiguousarray(values, dtype=_little_endian(dtype))
    if arr.ndim != 1:
        raise CodecError(f"arrays on the wire are 1-D, got shape {arr.shape}")
    return common_pb2.Array(dtype=dtype_code(arr.dtype), length=arr.size, data=arr.tobytes())


@functools.lru_cache(maxsize=64)
def _little_endian(dtype: np.dtype | str) -> np.dtype:
    return np.dtype(dtype).newbyteorder("<")


def encode_tensor(values: np.ndarray, dtype: np.dtype | str) -> common_pb2.Array:
    """Encode an array of any number of dimensions (row-major) as a wire Array with its shape; an empty array
    encodes as an unset Array."""
    arr = np.ascontiguousarray(values, dtype=_little_endian(dtype))
    if arr.size == 0:
        return common_pb2.Array()
    return common_pb2.Array(dtype=dtype_code(arr.dtype), length=arr.size, data=arr.tobytes(), shape=arr.shape)


def decode_tensor(msg: common_pb2.Array, field: str, expect: tuple[str, ...], ndim: int) -> np.ndarray:
    """Decode a shaped wire Array of `ndim` dimensions whose dtype is one of `expect`; an unset Array decodes to an
    empty array of shape (0,) * ndim."""
    if msg.dtype == common_pb2.DTYPE_UNSPECIFIED and msg.length == 0 and not msg.data:
        return np.empty((0,) * ndim, dtype=np.dtype(expect[0]))
    dt = _DTYPES.get(msg.dtype)
    if dt is None or dt not in [_little_endian(e) for e in expect]:
        raise CodecError(f"{field}: expected dtype {' or '.join(expect)}, got dtype code {msg.dtype}")
    shape = tuple(msg.shape)
    if len(shape) != ndim or int(np.prod(shape)) != msg.length:
        raise CodecError(f"{field}: shape {list(shape)} is not {ndim}-dimensional with {msg.length} elements")
    return decode_array(msg, field, dt).reshape(shape)


def decode_array(msg: common_pb2.Array, field: str = "array", expect: np.dtype | str | None = None) -> np.ndarray:
    """Decode a wire Array into a read-only numpy array; `field` names it in errors.

    An unset Array (no dtype, no data) decodes to an empty array of `expect` (or float32).
    """
    data, code = msg.data, msg.dtype  # read once: each read of a bytes field copies it
    if code == common_pb2.DTYPE_UNSPECIFIED and msg.length == 0 and not data:
        return np.empty(0, dtype=np.dtype(expect) if expect is not None else np.float32)
    dt = _DTYPES.get(code)
    if dt is None:  # unknown, or bfloat16 (no numpy type)
        raise CodecError(f"{field}: unsupported dtype code {code}")
    if expect is not None and dt != _little_endian(expect):
        raise CodecError(f"{field}: expected dtype {np.dtype(expect)}, got {dt.name}")
    if len(data) != msg.length * dt.itemsize:
        raise CodecError(
            f"{field}: {len(data)} bytes do not hold {msg.length} {dt.name} elements "
            f"({msg.length * dt.itemsize} bytes expected)"
        )
    return np.frombuffer(data, dtype=dt)


def pack_metadata(meta: dict[str, Any] | None) -> bytes:
    """Encode free-form metadata as msgpack ('' for none)."""
    return msgpack.packb(meta, use_bin_type=True) if meta else b""


def unpack_metadata(data: bytes, field: str = "metadata") -> dict[str, Any]:
    """Decode msgpack metadata; it must be a map."""
    if not data:
        return {}
    try:
        meta = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise CodecError(f"{field}: not valid msgpack ({exc})") from exc
    if not isinstance(meta, dict):
        raise CodecError(f"{field}: must be a msgpack map, got {type(meta).__name__}")
    return meta
