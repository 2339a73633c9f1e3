"""The wire codec: arrays as raw bytes, metadata as msgpack, the Sample round trip."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from protos import common_pb2
from protos.codec import CodecError, decode_array, encode_array, pack_metadata, unpack_metadata
from protos.sample import Sample, SampleStatus

DTYPES = ["int32", "int64", "float32", "float16", "uint8", "float64"]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(DTYPES).flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(max_dims=1, max_side=64))))
def test_array_round_trip(values):
    msg = common_pb2.Array.FromString(encode_array(values, values.dtype).SerializeToString())
    out = decode_array(msg, expect=values.dtype)
    assert out.dtype == values.dtype.newbyteorder("<")
    np.testing.assert_array_equal(out, values)


def test_big_endian_input_travels_little_endian():
    values = np.arange(5, dtype=">i4")
    msg = encode_array(values, ">i4")
    assert msg.data == np.arange(5, dtype="<i4").tobytes()


@pytest.mark.parametrize("length, data", [(3, b"\x00" * 8), (1, b"\x00" * 5), (0, b"\x01")])
def test_wrong_length_is_rejected_with_the_field_name(length, data):
    msg = common_pb2.Array(dtype=common_pb2.DTYPE_INT32, length=length, data=data)
    with pytest.raises(CodecError, match=r"prompt_ids: \d+ bytes do not hold"):
        decode_array(msg, field="prompt_ids")


def test_wrong_and_unknown_dtype_are_rejected():
    msg = encode_array([1.0, 2.0], "float32")
    with pytest.raises(CodecError, match="response_ids: expected dtype int32, got float32"):
        decode_array(msg, field="response_ids", expect="int32")
    with pytest.raises(CodecError, match="unsupported dtype code 99"):
        decode_array(common_pb2.Array(dtype=99, length=0), field="x")


def test_2d_arrays_do_not_travel():
    with pytest.raises(CodecError, match="1-D"):
        encode_array(np.zeros((2, 2)), "float32")


@given(st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-2**63, 2**63 - 1), st.text(), st.floats(allow_nan=False),
                                                      st.lists(st.integers(0, 9), max_size=5)), max_size=6))
def test_metadata_round_trip(meta):
    assert unpack_metadata(pack_metadata(meta)) == meta


def test_bad_metadata_is_rejected():
    with pytest.raises(CodecError, match="metadata: not valid msgpack"):
        unpack_metadata(b"\xc1")
    with pytest.raises(CodecError, match="must be a msgpack map"):
        unpack_metadata(b"\x93\x01\x02\x03")


def _sample(n_prompt: int, n_resp: int, seed: int) -> Sample:
    rng = np.random.default_rng(seed)
    return Sample(
        sample_id=f"s{seed}",
        prompt_id=f"p{seed}",
        prompt_ids=rng.integers(0, 100, n_prompt, dtype=np.int32),
        response_ids=rng.integers(0, 100, n_resp, dtype=np.int32),
        loss_mask=rng.integers(0, 2, n_resp, dtype=np.uint8),
        rollout_logprobs=-rng.random(n_resp, dtype=np.float32),
        weight_versions=rng.integers(0, 5, n_resp).astype(np.int64),
        reward=float(rng.random()),
        reward_details={"correct": 1.0},
        status=SampleStatus.TRUNCATED,
        reason="length",
        metadata={"answer": "42", "tests": ["assert f() == 1"]},
        group_size=4,
    )


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 64), st.integers(0, 64), st.integers(0, 2**16))
def test_sample_round_trip(n_prompt, n_resp, seed):
    sample = _sample(n_prompt, n_resp, seed)
    back = Sample.from_proto(common_pb2.Sample.FromString(sample.to_proto().SerializeToString()))
    for name in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions"):
        np.testing.assert_array_equal(getattr(back, name), getattr(sample, name))
    assert (back.sample_id, back.group_id, back.group_size, back.status, back.reason) == (
        sample.sample_id, sample.prompt_id, 4, SampleStatus.TRUNCATED, "length")
    assert back.metadata == sample.metadata and back.reward == sample.reward


def test_inconsistent_sample_names_the_field():
    msg = _sample(3, 5, 0).to_proto()
    msg.loss_mask.CopyFrom(encode_array([1, 1], "uint8"))
    with pytest.raises(CodecError, match="loss_mask: has 2 entries for 5 response tokens"):
        Sample.from_proto(msg)
    msg = _sample(3, 5, 0).to_proto()
    msg.status = 0
    with pytest.raises(CodecError, match="status"):
        Sample.from_proto(msg)


def test_oldest_version_counts_trained_tokens_only():
    sample = _sample(2, 3, 0)
    sample.loss_mask = np.array([0, 1, 1], np.uint8)
    sample.weight_versions = np.array([1, 5, 7], np.int64)
    assert sample.oldest_version == 5


@pytest.mark.parametrize("kv_version", [None, 0, 7])
def test_kv_version_travels_and_unset_stays_unknown(kv_version):
    """Sample.kv_version is optional on the wire: 0 is a version, unset (a producer that does not know) is None."""
    sample = _sample(2, 3, 0)
    sample.kv_version = kv_version
    msg = common_pb2.Sample.FromString(sample.to_proto().SerializeToString())
    assert msg.HasField("kv_version") == (kv_version is not None)
    assert Sample.from_proto(msg).kv_version == kv_version
