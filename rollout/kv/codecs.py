"""KV compression codecs: one small interface for the KV of some tokens, on the wire or resident in a cache.

A codec turns keys and values shaped [num_layers, num_tokens, num_kv_heads, head_dim] into an `EncodedKV`
(named tensors whose byte size is `nbytes`) and back. Codecs:

- `none`: the tensors as they are.
- `int8`, `int4`: asymmetric (min / scale) quantization with per-group float16 parameters, as KIVI does:
  keys per channel (each channel of each head, over groups of `key_group_size` tokens: keys have
  outlier channels, so a channel shares one range), values per token (each token of each head, over
  groups of `value_group_size` channels). int4 codes are packed two per byte along head_dim.

Every value is reconstructed within half a quantization step of its group (plus the float16 rounding of
the group's parameters): |x - decode(encode(x))| <= scale / 2 + 2**-10 * (|min| + |max|) of the group.
"""

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

CODECS = ("none", "int8", "int4")
PARAM_DTYPE = torch.float16  # the per-group min and scale (KIVI keeps them in half precision)


@dataclass(frozen=True)
class EncodedKV:
    """The KV of `shape` = (num_layers, num_tokens, num_kv_heads, head_dim) tokens in `dtype`, as `codec` holds it.

    `parts` are the codec's named tensors (see KVCodec.part_layout); their order is their order in bytes."""

    codec: str
    shape: tuple[int, int, int, int]
    dtype: torch.dtype
    parts: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(part.numel() * part.element_size() for part in self.parts.values())

    def to_buffer(self) -> torch.Tensor:
        """The parts' raw bytes, one after the other in part order (machine byte order: little-endian here), as one
        uint8 tensor on the parts' device."""
        return torch.cat([part.contiguous().view(torch.uint8).reshape(-1) for part in self.parts.values()])

    def to_bytes(self) -> bytes:
        """to_buffer()'s bytes on the host (copied there when the parts are on a device)."""
        return self.to_buffer().cpu().numpy().tobytes()


class KVCodec(ABC):
    name: str

    @abstractmethod
    def part_layout(self, shape: tuple[int, int, int, int], dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype) of each part of the encoding of KV of `shape` in `dtype`."""

    @abstractmethod
    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> EncodedKV:
        """keys, values: [num_layers, num_tokens, num_kv_heads, head_dim], same shape and dtype."""

    @abstractmethod
    def decode(self, encoded: EncodedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values) in the encoded shape and dtype, on the parts' device."""

    def encoded_nbytes(self, shape: tuple[int, int, int, int], dtype: torch.dtype) -> int:
        return sum(math.prod(s) * d.itemsize for s, d in self.part_layout(shape, dtype).values())

    def from_bytes(self, shape: tuple[int, int, int, int], dtype: torch.dtype, data: bytes | bytearray) -> EncodedKV:
        """The EncodedKV whose to_bytes() is `data`; raises ValueError when its length is not the layout's."""
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return self.from_buffer(shape, dtype, raw)

    def from_buffer(self, shape: tuple[int, int, int, int], dtype: torch.dtype, buffer: torch.Tensor) -> EncodedKV:
        """The EncodedKV whose to_buffer() is `buffer` (uint8, 1-D, on any device), its parts views of it; raises
        ValueError when its length is not the layout's."""
        layout = self.part_layout(shape, dtype)
        expected = sum(math.prod(s) * d.itemsize for s, d in layout.values())
        if buffer.numel() != expected:
            raise ValueError(f"payload: {buffer.numel()} bytes, the {self.name} encoding of {list(shape)} {dtype} is "
                             f"{expected} bytes")
        parts, offset = {}, 0
        for name, (part_shape, part_dtype) in layout.items():
            size = math.prod(part_shape) * part_dtype.itemsize
            parts[name] = buffer[offset : offset + size].view(part_dtype).reshape(part_shape)
            offset += size
        return EncodedKV(self.name, tuple(shape), dtype, parts)


class NoCompression(KVCodec):
    name = "none"

    def part_layout(self, shape, dtype):
        return {"keys": (tuple(shape), dtype), "values": (tuple(shape), dtype)}

    def encode(self, keys, values):
        _check(keys, values)
        return EncodedKV(self.name, tuple(keys.shape), keys.dtype, {"keys": keys, "values": values})

    def decode(self, encoded):
        return encoded.parts["keys"], encoded.parts["values"]


class Quantized(KVCodec):
    """int8 (bits=8) or int4 (bits=4) KIVI-style quantization; see the module docstring."""

    def __init__(self, bits: int, key_group_size: int = 64, value_group_size: int = 32):
        if bits not in (4, 8):
            raise ValueError(f"bits: 4 or 8, got {bits}")
        if key_group_size <= 0 or value_group_size <= 0:
            raise ValueError(f"group sizes must be > 0, got keys {key_group_size}, values {value_group_size}")
        self.bits = bits
        self.name = f"int{bits}"
        self.key_group_size = key_group_size
        self.value_group_size = value_group_size

    def _value_group(self, head_dim: int) -> int:
        """Channels per value group: value_group_size when it divides head_dim, else the whole head."""
        return self.value_group_size if head_dim % self.value_group_size == 0 else head_dim

    def _codes_shape(self, shape) -> tuple[int, ...]:
        layers, tokens, heads, head_dim = shape
        if self.bits == 4 and head_dim % 2:
            raise ValueError(f"head_dim: int4 packs two codes per byte and needs an even head_dim, got {head_dim}")
        return (layers, tokens, heads, head_dim * self.bits // 8)

    def part_layout(self, shape, dtype):
        layers, tokens, heads, head_dim = shape
        codes = (self._codes_shape(shape), torch.uint8)
        key_params = ((layers, -(-tokens // self.key_group_size), heads, head_dim), PARAM_DTYPE)
        value_params = ((layers, tokens, heads, head_dim // self._value_group(head_dim)), PARAM_DTYPE)
        return {"key_codes": codes, "key_mins": key_params, "key_scales": key_params,
                "value_codes": codes, "value_mins": value_params, "value_scales": value_params}

    def encode(self, keys, values):
        _check(keys, values)
        self._codes_shape(keys.shape)
        layers, tokens, heads, head_dim = keys.shape
        groups = -(-tokens // self.key_group_size)
        padded = tokens if tokens % self.key_group_size == 0 else groups * self.key_group_size
        # keys: [L, groups, G, H, D], a group is G tokens of one channel (padding repeats the last token)
        k = keys.float()
        if padded > tokens:
            k = torch.cat([k, k[:, -1:].expand(layers, padded - tokens, heads, head_dim)], dim=1)
        k = k.view(layers, groups, self.key_group_size, heads, head_dim)
        key_codes, key_mins, key_scales = self._quantize(k, dim=2)
        key_codes = key_codes.view(layers, padded, heads, head_dim)[:, :tokens]
        # values: [L, T, H, D / G, G], a group is G channels of one token
        group = self._value_group(head_dim)
        v = values.float().view(layers, tokens, heads, head_dim // group, group)
        value_codes, value_mins, value_scales = self._quantize(v, dim=4)
        return EncodedKV(self.name, tuple(keys.shape), keys.dtype, {
            "key_codes": self._pack(key_codes), "key_mins": key_mins.squeeze(2), "key_scales": key_scales.squeeze(2),
            "value_codes": self._pack(value_codes.view(layers, tokens, heads, head_dim)),
            "value_mins": value_mins.squeeze(4), "value_scales": value_scales.squeeze(4),
        })

    def decode(self, encoded):
        keys = torch.empty(encoded.shape, dtype=encoded.dtype, device=encoded.parts["key_codes"].device)
        values = torch.empty_like(keys)
        self.decode_into(encoded, keys, values)
        return keys, values

    def decode_into(self, encoded: EncodedKV, keys: torch.Tensor, values: torch.Tensor) -> None:
        """decode(encoded), written into keys and values (contiguous, shaped encoded.shape, in any float dtype, on the
        parts' device): each value is min + code * scale of its group, worked out per element in float32 and rounded
        once to the outputs' dtype, with no float32 copy of the whole (the resident cache reads into its workspace)."""
        layers, tokens, heads, head_dim = encoded.shape
        p = encoded.parts
        size = self.key_group_size
        keys.copy_(self._unpack(p["key_codes"], head_dim))  # codes are exact in every float dtype
        full = tokens // size
        if full:
            k = keys[:, : full * size].view(layers, full, size, heads, head_dim)
            torch.addcmul(p["key_mins"][:, :full].unsqueeze(2), k, p["key_scales"][:, :full].unsqueeze(2), out=k)
        if tokens > full * size:  # the last group, of fewer tokens
            k = keys[:, full * size :]
            torch.addcmul(p["key_mins"][:, full:], k, p["key_scales"][:, full:], out=k)
        group = self._value_group(head_dim)
        v = values.view(layers, tokens, heads, head_dim // group, group)
        v.copy_(self._unpack(p["value_codes"], head_dim).view(v.shape))
        torch.addcmul(p["value_mins"].unsqueeze(4), v, p["value_scales"].unsqueeze(4), out=v)

    def _quantize(self, x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes (uint8, unpacked) of x over groups along `dim`, and each group's float16 min and scale."""
        levels = (1 << self.bits) - 1
        low = x.amin(dim=dim, keepdim=True)
        high = x.amax(dim=dim, keepdim=True)
        mins = low.to(PARAM_DTYPE)
        # Widened by one float16 step before rounding, so the group's range still fits in `levels` steps.
        scales = ((high - mins.float()) / levels * (1 + 2**-10)).to(PARAM_DTYPE)
        step = torch.where(scales > 0, scales.float(), 1.0)
        codes = ((x - mins.float()) / step).round_().clamp_(0, levels).to(torch.uint8)
        return codes, mins, scales

    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return codes.contiguous()
        return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()

    def _unpack(self, packed: torch.Tensor, head_dim: int) -> torch.Tensor:
        if self.bits == 8:
            return packed
        return torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(*packed.shape[:-1], head_dim)


def make_codec(name: str) -> KVCodec:
    """The codec called `name` (one of CODECS), with its default group sizes."""
    if name == "none":
        return NoCompression()
    if name == "int8":
        return Quantized(8)
    if name == "int4":
        return Quantized(4)
    raise ValueError(f"codec: {name!r} is not one of {CODECS}")


def _check(keys: torch.Tensor, values: torch.Tensor) -> None:
    if keys.dim() != 4 or keys.shape != values.shape or keys.dtype != values.dtype:
        raise ValueError(f"keys and values must both be [num_layers, num_tokens, num_kv_heads, head_dim] of one dtype, "
                         f"got {list(keys.shape)} {keys.dtype} and {list(values.shape)} {values.dtype}")
