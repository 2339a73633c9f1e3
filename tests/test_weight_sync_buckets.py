"""Bucket planning, packing and the manifest's wire form (pure logic, no processes)."""

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protos import weights_pb2
from protos.codec import CodecError
from services.weights import (
    Manifest,
    allocate_staging,
    merge_order,
    pack_bucket,
    plan_buckets,
    unpack_bucket,
    unpack_buckets,
)
from services.weights.manifest import ALIGN_BYTES

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.float64, torch.int32]


def _tensors(shapes_dtypes, seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, (shape, dtype) in enumerate(shapes_dtypes):
        values = torch.randn(shape, generator=gen) * 100
        out[f"layer.{i}.weight"] = values.to(dtype)
    return out


def test_plan_keeps_order_fills_buckets_and_gives_big_tensors_their_own():
    tensors = _tensors([((10,), torch.float32), ((7,), torch.float16), ((300,), torch.float32), ((3,), torch.uint8)])
    manifest = plan_buckets(tensors, bucket_bytes=256)
    slots = {s.name: s for s in manifest.slots}
    assert [s.name for s in manifest.slots] == list(tensors)
    assert slots["layer.0.weight"].bucket == slots["layer.1.weight"].bucket == 0
    assert slots["layer.1.weight"].offset == ALIGN_BYTES  # 40 bytes, then aligned
    assert slots["layer.2.weight"].bucket == 1 and manifest.bucket_sizes[1] == 1200  # larger than a bucket
    assert slots["layer.3.weight"].bucket == 2
    assert manifest.bucket_sizes == (ALIGN_BYTES + 14, 1200, 3)


@settings(max_examples=40, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.lists(st.integers(0, 9), min_size=0, max_size=3), st.sampled_from(DTYPES)), min_size=1, max_size=12
    ),
    bucket_bytes=st.integers(1, 600),
)
def test_pack_unpack_round_trip_is_exact(specs, bucket_bytes):
    tensors = _tensors([(tuple(shape), dtype) for shape, dtype in specs])
    manifest = plan_buckets(tensors, bucket_bytes)
    assert sum(len(group) for group in manifest.by_bucket) == len(tensors)
    received = {}
    for index in range(len(manifest.bucket_sizes)):
        bucket = pack_bucket(manifest, index, tensors)
        assert bucket.numel() == manifest.bucket_sizes[index] and bucket.dtype == torch.uint8
        wire = bucket.clone()  # what a receiver would hold after the broadcast
        received.update(unpack_bucket(manifest, index, wire))
    assert received.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor), name


def test_pack_reuses_a_buffer_and_rejects_a_tensor_that_does_not_match_the_manifest():
    tensors = _tensors([((4, 4), torch.float32), ((8,), torch.float32)])
    manifest = plan_buckets(tensors, bucket_bytes=1 << 20)
    buffer = torch.empty(4096, dtype=torch.uint8)
    bucket = pack_bucket(manifest, 0, tensors, out=buffer)
    assert bucket.data_ptr() == buffer.data_ptr()
    wrong = dict(tensors, **{"layer.1.weight": torch.zeros(9)})
    with pytest.raises(ValueError, match="layer.1.weight"):
        pack_bucket(manifest, 0, wrong)


def test_manifest_survives_the_wire():
    tensors = _tensors([((3, 5), torch.bfloat16), ((2,), torch.int64), ((100,), torch.float32)])
    manifest = plan_buckets(tensors, bucket_bytes=128)
    specs, sizes = manifest.to_proto()
    request = weights_pb2.BeginUpdateRequest(version=3, tensors=specs, bucket_sizes=sizes)
    again = Manifest.from_proto(weights_pb2.BeginUpdateRequest.FromString(request.SerializeToString()).tensors, sizes)
    assert again == manifest
    assert again.layout() == {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}


def test_merge_order_sends_merged_projections_back_to_back_and_staging_keeps_them_adjacent():
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    shapes = {"model.embed_tokens.weight": (50, 32), mlp + "down_proj.weight": (32, 64),
              mlp + "gate_proj.weight": (64, 32), mlp + "up_proj.weight": (64, 32),
              attn + "k_proj.bias": (16,), attn + "k_proj.weight": (16, 32), attn + "o_proj.weight": (32, 32),
              attn + "q_proj.bias": (32,), attn + "q_proj.weight": (32, 32), attn + "v_proj.bias": (16,),
              attn + "v_proj.weight": (16, 32)}  # as a safetensors file lists a Qwen2 layer: sorted, biases interleaved
    ordered = merge_order([(name, shape, torch.float32) for name, shape in shapes.items()])
    assert [name for name, _, _ in ordered] == [
        "model.embed_tokens.weight", mlp + "down_proj.weight", mlp + "gate_proj.weight", mlp + "up_proj.weight",
        attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight", attn + "o_proj.weight",
        attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias"]
    # Buckets smaller than q/k/v together: the staging buffers still hold them back to back.
    manifest = plan_buckets(ordered, bucket_bytes=6000)
    assert len(manifest.bucket_sizes) > 3
    views = unpack_buckets(manifest, allocate_staging(manifest, torch.device("cpu")))
    for parts in (["q_proj.weight", "k_proj.weight", "v_proj.weight"], ["q_proj.bias", "k_proj.bias", "v_proj.bias"]):
        tensors = [views[attn + part] for part in parts]
        for before, after in itertools.pairwise(tensors):
            assert after.data_ptr() == before.data_ptr() + before.nbytes
    assert views[mlp + "up_proj.weight"].data_ptr() == views[mlp + "gate_proj.weight"].data_ptr() + 64 * 32 * 4


def _spec(name="w", shape=(4,), dtype=3, bucket=0, offset=0):
    return weights_pb2.TensorSpec(name=name, shape=shape, dtype=dtype, bucket=bucket, offset=offset)


@pytest.mark.parametrize(
    "specs, sizes, message",
    [
        ([], [16], "empty"),
        ([_spec(), _spec()], [64], "unique"),
        ([_spec(dtype=0)], [16], "unsupported dtype"),
        ([_spec(bucket=2)], [16], "bucket 2"),
        ([_spec(shape=(8,))], [16], "inside bucket 0"),
        ([_spec(offset=8)], [64], "aligned"),
        ([_spec("a", shape=(20,)), _spec("b", offset=64)], [128], "overlaps"),
    ],
)
def test_a_bad_manifest_is_a_codec_error_naming_the_tensor(specs, sizes, message):
    with pytest.raises(CodecError, match=message):
        Manifest.from_proto(specs, sizes)
