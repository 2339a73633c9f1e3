from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_FLOAT64: _ClassVar[DType]
    DTYPE_UINT16: _ClassVar[DType]

class SampleStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAMPLE_STATUS_UNSPECIFIED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_COMPLETED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_TRUNCATED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_ABORTED: _ClassVar[SampleStatus]
    SAMPLE_STATUS_FAILED: _ClassVar[SampleStatus]
DTYPE_UNSPECIFIED: DType
DTYPE_INT32: DType
DTYPE_INT64: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_UINT8: DType
DTYPE_FLOAT64: DType
DTYPE_UINT16: DType
SAMPLE_STATUS_UNSPECIFIED: SampleStatus
SAMPLE_STATUS_COMPLETED: SampleStatus
SAMPLE_STATUS_TRUNCATED: SampleStatus
SAMPLE_STATUS_ABORTED: SampleStatus
SAMPLE_STATUS_FAILED: SampleStatus

class Array(_message.Message):
    __slots__ = ("dtype", "length", "data", "shape")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    length: int
    data: bytes
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., length: _Optional[int] = ..., data: _Optional[bytes] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("sample_id", "prompt_id", "group_id", "group_size", "prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions", "reward", "reward_details", "turn_rewards", "status", "reason", "prompt_text", "response_text", "metadata", "ref_logprobs", "values", "advantages", "temperature", "kv_version", "routed_experts", "images")
    class RewardDetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    REWARD_DETAILS_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARDS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_TEXT_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REF_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    KV_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt_id: str
    group_id: str
    group_size: int
    prompt_ids: Array
    response_ids: Array
    loss_mask: Array
    rollout_logprobs: Array
    weight_versions: Array
    reward: float
    reward_details: _containers.ScalarMap[str, float]
    turn_rewards: Array
    status: SampleStatus
    reason: str
    prompt_text: str
    response_text: str
    metadata: bytes
    ref_logprobs: Array
    values: Array
    advantages: Array
    temperature: float
    kv_version: int
    routed_experts: Array
    images: _containers.RepeatedCompositeFieldContainer[ImageRef]
    def __init__(self, sample_id: _Optional[str] = ..., prompt_id: _Optional[str] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., prompt_ids: _Optional[_Union[Array, _Mapping]] = ..., response_ids: _Optional[_Union[Array, _Mapping]] = ..., loss_mask: _Optional[_Union[Array, _Mapping]] = ..., rollout_logprobs: _Optional[_Union[Array, _Mapping]] = ..., weight_versions: _Optional[_Union[Array, _Mapping]] = ..., reward: _Optional[float] = ..., reward_details: _Optional[_Mapping[str, float]] = ..., turn_rewards: _Optional[_Union[Array, _Mapping]] = ..., status: _Optional[_Union[SampleStatus, str]] = ..., reason: _Optional[str] = ..., prompt_text: _Optional[str] = ..., response_text: _Optional[str] = ..., metadata: _Optional[bytes] = ..., ref_logprobs: _Optional[_Union[Array, _Mapping]] = ..., values: _Optional[_Union[Array, _Mapping]] = ..., advantages: _Optional[_Union[Array, _Mapping]] = ..., temperature: _Optional[float] = ..., kv_version: _Optional[int] = ..., routed_experts: _Optional[_Union[Array, _Mapping]] = ..., images: _Optional[_Iterable[_Union[ImageRef, _Mapping]]] = ...) -> None: ...

class ImageRef(_message.Message):
    __slots__ = ("sha256", "media_type", "grid_thw", "num_tokens", "data")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    sha256: bytes
    media_type: str
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    data: bytes
    def __init__(self, sha256: _Optional[bytes] = ..., media_type: _Optional[str] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
