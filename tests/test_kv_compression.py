"""KV codecs (rollout/kv/codecs.py): round-trip error bounds, exact byte sizes, bytes round trip."""

import math

import pytest
import torch

from rollout.kv.codecs import CODECS, PARAM_DTYPE, Quantized, make_codec

SHAPE = (2, 37, 3, 32)  # layers, tokens (not a multiple of the key group), kv heads, head_dim


def kv(shape=SHAPE, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(shape, generator=gen) * 2
    keys[..., 5] += 20  # an outlier channel, as real keys have: per-channel groups keep it from hurting the rest
    values = torch.randn(shape, generator=gen)
    return keys.to(dtype), values.to(dtype)


def test_none_is_lossless_and_exact_in_bytes():
    codec = make_codec("none")
    keys, values = kv()
    encoded = codec.encode(keys, values)
    assert encoded.nbytes == 2 * math.prod(SHAPE) * 4 == len(encoded.to_bytes()) == codec.encoded_nbytes(SHAPE, torch.float32)
    back = codec.decode(codec.from_bytes(SHAPE, torch.float32, encoded.to_bytes()))
    assert torch.equal(back[0], keys) and torch.equal(back[1], values)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_error_is_within_half_a_step_of_each_group(bits):
    codec = Quantized(bits, key_group_size=16, value_group_size=8)
    keys, values = kv()
    dk, dv = codec.decode(codec.encode(keys, values))
    assert dk.shape == keys.shape and dv.dtype == values.dtype
    levels = (1 << bits) - 1
    # keys: groups of 16 tokens per (layer, head, channel); the last group holds the 5 tokens left
    for start in range(0, SHAPE[1], 16):
        k = keys[:, start:start + 16]
        lo, hi = k.amin(dim=1, keepdim=True), k.amax(dim=1, keepdim=True)
        bound = (hi - lo) / levels / 2 * (1 + 2**-9) + 2**-10 * (lo.abs() + hi.abs()) + 1e-6
        assert ((dk[:, start:start + 16] - k).abs() <= bound).all()
    # values: groups of 8 channels per (layer, token, head)
    v = values.view(*SHAPE[:3], 4, 8)
    lo, hi = v.amin(dim=-1, keepdim=True), v.amax(dim=-1, keepdim=True)
    bound = (hi - lo) / levels / 2 * (1 + 2**-9) + 2**-10 * (lo.abs() + hi.abs()) + 1e-6
    assert ((dv.view(*SHAPE[:3], 4, 8) - v).abs() <= bound).all()
    # and the error is a quantization error, not zero and not garbage
    relative = (dv - values).norm() / values.norm()
    assert (1e-4 if bits == 8 else 1e-2) < relative < (0.02 if bits == 8 else 0.3)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_quantized_byte_sizes_are_exact(name):
    codec = make_codec(name)
    layers, tokens, heads, head_dim = SHAPE
    encoded = codec.encode(*kv())
    codes = layers * tokens * heads * head_dim * (1 if name == "int8" else 0.5)
    key_params = layers * -(-tokens // codec.key_group_size) * heads * head_dim
    value_params = layers * tokens * heads * (head_dim // codec.value_group_size)
    expected = int(2 * codes + 2 * PARAM_DTYPE.itemsize * (key_params + value_params))
    assert encoded.nbytes == expected == len(encoded.to_bytes()) == codec.encoded_nbytes(SHAPE, torch.float32)
    assert encoded.parts["key_codes"].dtype == torch.uint8


@pytest.mark.parametrize("name", CODECS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bytes_round_trip_gives_the_same_decode(name, dtype):
    codec = make_codec(name)
    keys, values = kv(dtype=dtype)
    encoded = codec.encode(keys, values)
    again = codec.from_bytes(SHAPE, dtype, encoded.to_bytes())
    for a, b in zip(codec.decode(encoded), codec.decode(again)):
        assert a.dtype == dtype and torch.equal(a, b)


def test_int8_cuts_float32_bytes_by_more_than_3_5x_on_a_prompt_of_64_tokens():
    shape = (2, 64, 2, 32)
    none = make_codec("none").encoded_nbytes(shape, torch.float32)
    assert none / make_codec("int8").encoded_nbytes(shape, torch.float32) >= 3.5
    assert none / make_codec("int4").encoded_nbytes(shape, torch.float32) >= 6


def test_constant_groups_and_int4_packing_round_trip_exactly():
    keys = torch.full(SHAPE, 0.5)
    values = torch.zeros(SHAPE)
    for name in ("int8", "int4"):
        dk, dv = make_codec(name).decode(make_codec(name).encode(keys, values))
        assert torch.equal(dk, keys) and torch.equal(dv, values)
    codec = Quantized(4, key_group_size=4, value_group_size=4)
    levels = torch.arange(16, dtype=torch.float32)  # every int4 code once per group of 16 channels
    values = levels.repeat(1, 4, 1, 2).view(1, 4, 1, 32)
    _, dv = codec.decode(codec.encode(values.clone(), values))
    assert torch.allclose(dv, values, atol=2**-10 * 15)


def test_wrong_length_and_bad_inputs_are_refused():
    codec = make_codec("int8")
    data = codec.encode(*kv()).to_bytes()
    with pytest.raises(ValueError, match="payload"):
        codec.from_bytes(SHAPE, torch.float32, data[:-1])
    with pytest.raises(ValueError, match="keys and values"):
        codec.encode(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="even head_dim"):
        make_codec("int4").encode(torch.zeros(1, 2, 1, 3), torch.zeros(1, 2, 1, 3))
    with pytest.raises(ValueError, match="codec"):
        make_codec("fp8")
