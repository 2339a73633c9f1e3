"""The KV transfer format (rollout/pd/transfer.py): a round trip, and every refusal with its typed error."""

import pytest
import torch

from protos import kv_pb2, rollout_pb2
from protos.codec import encode_array
from rollout.engine.errors import KVTransferCorrupt, KVTransferInvalid, KVWeightVersionMismatch
from rollout.kv.prefilled import PrefilledPrompt, ServedLayout
from rollout.pd.transfer import pack, unpack

SERVED = ServedLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, vocab_size=101, weight_version=3)


def prefilled(tokens=21, dtype=torch.float32, version=3):
    gen = torch.Generator().manual_seed(1)
    shape = (2, tokens, 2, 32)
    return PrefilledPrompt(prompt_ids=list(range(5, 5 + tokens)), keys=torch.randn(shape, generator=gen).to(dtype),
                           values=torch.randn(shape, generator=gen).to(dtype), first_token_ids=[7, 9],
                           first_logprobs=[-0.5, -1.25], seed=1234, weight_version=version)


def request():
    return rollout_pb2.GenerateRequest(request_id="r1", prompt_text="ignored: the ids travel",
                                       params=rollout_pb2.SamplingParams(n=2, max_tokens=8, logprobs=True),
                                       routing_key="k")


def chunks(codec="none", chunk_bytes=1000, **kwargs):
    return list(pack(request(), prefilled(**kwargs), codec, chunk_bytes))


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_round_trip_carries_request_seed_first_tokens_and_kv(codec):
    sent = prefilled()
    stream = list(pack(request(), sent, codec, chunk_bytes=1000))
    assert stream[0].WhichOneof("kind") == "header" and len(stream) > 3
    got = unpack(stream, SERVED)
    assert got.request.request_id == "r1" and got.request.routing_key == "k" and got.request.prompt_text == ""
    assert got.prefilled.prompt_ids == sent.prompt_ids and got.request.params.seed == 1234 == got.prefilled.seed
    assert got.prefilled.first_token_ids == [7, 9] and got.prefilled.first_logprobs == [-0.5, -1.25]
    assert got.payload_bytes == sum(len(c.payload) for c in stream[1:])
    if codec == "none":
        assert torch.equal(got.prefilled.keys, sent.keys) and torch.equal(got.prefilled.values, sent.values)
        assert got.payload_bytes == 2 * sent.keys.numel() * 4
    else:
        tolerance = 0.1 if codec == "int8" else 1.0
        assert (got.prefilled.keys - sent.keys).abs().max() < tolerance
        assert got.payload_bytes < 2 * sent.keys.numel() * 4 / (3 if codec == "int8" else 5)


def with_header(stream, **changes):
    header = kv_pb2.KVTransferHeader()
    header.CopyFrom(stream[0].header)
    for path, value in changes.items():
        target = header
        *parents, leaf = path.split(".")
        for part in parents:
            target = getattr(target, part)
        setattr(target, leaf, value)
    return [kv_pb2.KVTransferChunk(header=header), *stream[1:]]


@pytest.mark.parametrize("changes, match", [
    ({"layout.num_layers": 3}, "layout"),
    ({"layout.head_dim": 16}, "layout"),
    ({"layout.dtype": "bfloat16"}, "dtype"),
    ({"layout.num_tokens": 20}, "num_tokens"),
    ({"codec": "fp8"}, "codec"),
    ({"payload_bytes": 12}, "payload_bytes"),
])
def test_wrong_layout_shape_dtype_or_codec_is_invalid(changes, match):
    with pytest.raises(KVTransferInvalid, match=match):
        unpack(with_header(chunks(), **changes), SERVED)


def test_wrong_first_tokens_missing_seed_and_chunk_order_are_invalid():
    stream = chunks()
    bad = with_header(stream)
    bad[0].header.first_token_ids.CopyFrom(encode_array([7], "int32"))
    with pytest.raises(KVTransferInvalid, match="one per completion"):
        unpack(bad, SERVED)
    bad = with_header(stream)
    bad[0].header.first_token_ids.CopyFrom(encode_array([7, 500], "int32"))
    with pytest.raises(KVTransferInvalid, match="vocabulary"):
        unpack(bad, SERVED)
    bad = with_header(stream)
    bad[0].header.request.params.ClearField("seed")
    with pytest.raises(KVTransferInvalid, match="seed"):
        unpack(bad, SERVED)
    with pytest.raises(KVTransferInvalid, match="one header chunk"):
        unpack([stream[1], stream[0], *stream[2:]], SERVED)
    with pytest.raises(KVTransferInvalid, match="empty"):
        unpack([], SERVED)
    with pytest.raises(KVTransferInvalid, match="dtype"):  # bfloat16 KV offered to a float32 cache
        unpack(chunks(dtype=torch.bfloat16), SERVED)


def test_flipped_or_missing_payload_bytes_are_data_loss():
    stream = chunks()
    flipped = bytearray(stream[2].payload)
    flipped[10] ^= 0x40
    with pytest.raises(KVTransferCorrupt, match="CRC-32"):
        unpack([*stream[:2], kv_pb2.KVTransferChunk(payload=bytes(flipped)), *stream[3:]], SERVED)
    with pytest.raises(KVTransferCorrupt, match="announced"):
        unpack(stream[:-1], SERVED)


def test_other_weight_version_is_refused():
    with pytest.raises(KVWeightVersionMismatch, match="version 2"):
        unpack(chunks(version=2), SERVED)
