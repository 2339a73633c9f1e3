"""The KV transfer format (rollout/pd/transfer.py): a round trip, and every refusal with its typed error."""

import contextlib

import pytest
import torch

from protos import kv_pb2, rollout_pb2
from protos.codec import encode_array
from rollout.engine.errors import KVTransferCorrupt, KVTransferInvalid, KVWeightVersionMismatch
from rollout.kv.codecs import make_codec
from rollout.kv.prefilled import PrefilledPrompt, ServedLayout
from rollout.pd.transfer import encode_payload, pack, unpack

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


@contextlib.contextmanager
def numpy_only_after_cpu():
    """Tensor.numpy() refuses, as it does for a tensor on a GPU, every tensor that no explicit .cpu() made."""
    moved: dict[int, torch.Tensor] = {}  # id -> the tensor (kept alive, so its id is not reused)
    cpu, numpy = torch.Tensor.cpu, torch.Tensor.numpy

    def tracked_cpu(self, *args, **kwargs):
        out = cpu(self, *args, **kwargs)
        moved[id(out)] = out
        return out

    def guarded_numpy(self, *args, **kwargs):
        if id(self) not in moved:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor "
                            "to host memory first.")
        return numpy(self, *args, **kwargs)

    torch.Tensor.cpu, torch.Tensor.numpy = tracked_cpu, guarded_numpy
    try:
        yield
    finally:
        torch.Tensor.cpu, torch.Tensor.numpy = cpu, numpy


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
def test_the_payload_goes_to_the_host_explicitly_before_it_becomes_bytes(codec):
    """A prefill worker on CUDA failed every transfer (issue 28): to_bytes called .numpy() on the KV where the
    engine left it, on the GPU. The encoded payload is one buffer on the KV's device, copied to the host once."""
    sent = prefilled()
    with numpy_only_after_cpu():
        stream = list(pack(request(), sent, codec, chunk_bytes=1000))
        data = make_codec(codec).encode(sent.keys, sent.values).to_bytes()
    assert sum(len(c.payload) for c in stream) == len(data) == stream[0].header.payload_bytes
    got = unpack(stream, SERVED)
    expected = make_codec(codec).decode(make_codec(codec).encode(sent.keys, sent.values))
    assert torch.equal(got.prefilled.keys, expected[0]) and torch.equal(got.prefilled.values, expected[1])


def test_a_group_payload_is_decoded_where_it_arrived_and_travels_as_it_is():
    """A header for a KV group payload carries no chunks; unpack decodes the tensor the group delivered, in place."""
    sent = prefilled()
    payload = encode_payload(sent, "none")
    (header,) = pack(request(), sent, "none", payload=payload, payload_from_rank=0)
    assert header.header.payload_bytes == payload.numel() and header.header.payload_from_rank == 0
    got = unpack([header], SERVED, payload)
    assert torch.equal(got.prefilled.keys, sent.keys)
    assert got.prefilled.keys.untyped_storage().data_ptr() == payload.untyped_storage().data_ptr()
    with pytest.raises(KVTransferCorrupt, match="CRC-32"):
        unpack([header], SERVED, payload.clone().index_fill_(0, torch.tensor([5]), 1))


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["none", "int8"])
def test_a_prefill_on_cuda_packs_and_its_kv_decodes_on_either_side(sharp_model_dir, codec):
    """The fault as it was seen: KV exported from an engine on CUDA. Over gRPC it decodes on the host; as a group
    payload (an NCCL group's) it stays on the GPU and decodes there, without a CRC-32."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from rollout.config import EngineConfig
    from rollout.engine.kv_handoff import prefill_for_transfer, served_layout
    from rollout.engine.llm_engine import LLMEngine
    from rollout.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, n=2)
    engines = {device: LLMEngine(EngineConfig(model=str(sharp_model_dir), device=device, max_model_len=128))
               for device in ("cuda", "cpu")}
    made = {device: prefill_for_transfer(e, "r", list(range(3, 40)), params) for device, e in engines.items()}
    assert made["cuda"].keys.is_cuda
    ask = rollout_pb2.GenerateRequest(request_id="r", params=rollout_pb2.SamplingParams(n=2))
    over_grpc = unpack(pack(ask, made["cuda"], codec), served_layout(engines["cpu"]))
    reference = unpack(pack(ask, made["cpu"], codec), served_layout(engines["cpu"]))
    torch.testing.assert_close(over_grpc.prefilled.keys, reference.prefilled.keys, atol=2e-2, rtol=0)
    payload = encode_payload(made["cuda"], codec)
    (header,) = pack(ask, made["cuda"], codec, payload=payload, payload_from_rank=0)
    assert payload.is_cuda and header.header.checksum == 0
    on_gpu = unpack([header], served_layout(engines["cuda"]), payload)
    assert on_gpu.prefilled.keys.is_cuda
    torch.testing.assert_close(on_gpu.prefilled.keys.cpu(), over_grpc.prefilled.keys)
