from protos import common_pb2 as _common_pb2
from protos import rollout_pb2 as _rollout_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request", "codec", "kv_group_rank", "kv_group_tag")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_RANK_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_TAG_FIELD_NUMBER: _ClassVar[int]
    request: _rollout_pb2.GenerateRequest
    codec: str
    kv_group_rank: int
    kv_group_tag: int
    def __init__(self, request: _Optional[_Union[_rollout_pb2.GenerateRequest, _Mapping]] = ..., codec: _Optional[str] = ..., kv_group_rank: _Optional[int] = ..., kv_group_tag: _Optional[int] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_tokens", "num_kv_heads", "head_dim", "dtype")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    def __init__(self, num_layers: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KVTransferHeader(_message.Message):
    __slots__ = ("request", "layout", "codec", "weight_version", "payload_bytes", "checksum", "first_token_ids", "first_logprobs", "payload_from_rank", "mrope_positions", "mrope_delta")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FROM_RANK_FIELD_NUMBER: _ClassVar[int]
    MROPE_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MROPE_DELTA_FIELD_NUMBER: _ClassVar[int]
    request: _rollout_pb2.GenerateRequest
    layout: KVLayout
    codec: str
    weight_version: int
    payload_bytes: int
    checksum: int
    first_token_ids: _common_pb2.Array
    first_logprobs: _common_pb2.Array
    payload_from_rank: int
    mrope_positions: _common_pb2.Array
    mrope_delta: int
    def __init__(self, request: _Optional[_Union[_rollout_pb2.GenerateRequest, _Mapping]] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., codec: _Optional[str] = ..., weight_version: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., checksum: _Optional[int] = ..., first_token_ids: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., first_logprobs: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., payload_from_rank: _Optional[int] = ..., mrope_positions: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., mrope_delta: _Optional[int] = ...) -> None: ...

class KVTransferChunk(_message.Message):
    __slots__ = ("header", "payload")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    header: KVTransferHeader
    payload: bytes
    def __init__(self, header: _Optional[_Union[KVTransferHeader, _Mapping]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("free_blocks", "num_blocks", "running", "waiting", "weight_version")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    num_blocks: int
    running: int
    waiting: int
    weight_version: int
    def __init__(self, free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., weight_version: _Optional[int] = ...) -> None: ...
