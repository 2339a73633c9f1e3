from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BucketEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BUCKET_WHOLE: _ClassVar[BucketEncoding]
    BUCKET_DELTA: _ClassVar[BucketEncoding]
    BUCKET_UNCHANGED: _ClassVar[BucketEncoding]
BUCKET_WHOLE: BucketEncoding
BUCKET_DELTA: BucketEncoding
BUCKET_UNCHANGED: BucketEncoding

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "bucket", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: _common_pb2.DType
    bucket: int
    offset: int
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[_common_pb2.DType, str]] = ..., bucket: _Optional[int] = ..., offset: _Optional[int] = ...) -> None: ...

class TransferGroup(_message.Message):
    __slots__ = ("backend", "master_addr", "master_port", "world_size", "rank", "group_name", "existing")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    EXISTING_FIELD_NUMBER: _ClassVar[int]
    backend: str
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    group_name: str
    existing: bool
    def __init__(self, backend: _Optional[str] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., group_name: _Optional[str] = ..., existing: _Optional[bool] = ...) -> None: ...

class BeginUpdateRequest(_message.Message):
    __slots__ = ("version", "tensors", "bucket_sizes", "group", "timeout_s", "base_version", "parts", "sender_groups")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    BUCKET_SIZES_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    SENDER_GROUPS_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    bucket_sizes: _containers.RepeatedScalarFieldContainer[int]
    group: TransferGroup
    timeout_s: float
    base_version: int
    parts: _containers.RepeatedCompositeFieldContainer[BucketPart]
    sender_groups: _containers.RepeatedCompositeFieldContainer[TransferGroup]
    def __init__(self, version: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., bucket_sizes: _Optional[_Iterable[int]] = ..., group: _Optional[_Union[TransferGroup, _Mapping]] = ..., timeout_s: _Optional[float] = ..., base_version: _Optional[int] = ..., parts: _Optional[_Iterable[_Union[BucketPart, _Mapping]]] = ..., sender_groups: _Optional[_Iterable[_Union[TransferGroup, _Mapping]]] = ...) -> None: ...

class BucketPart(_message.Message):
    __slots__ = ("bucket", "encoding", "wire_bytes", "words", "sender", "checksum")
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    ENCODING_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORDS_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    bucket: int
    encoding: BucketEncoding
    wire_bytes: int
    words: int
    sender: int
    checksum: int
    def __init__(self, bucket: _Optional[int] = ..., encoding: _Optional[_Union[BucketEncoding, str]] = ..., wire_bytes: _Optional[int] = ..., words: _Optional[int] = ..., sender: _Optional[int] = ..., checksum: _Optional[int] = ...) -> None: ...

class BeginUpdateResponse(_message.Message):
    __slots__ = ("current_version", "tensor_broadcasts", "needs_full", "partial_updates")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_BROADCASTS_FIELD_NUMBER: _ClassVar[int]
    NEEDS_FULL_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_UPDATES_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    tensor_broadcasts: bool
    needs_full: bool
    partial_updates: bool
    def __init__(self, current_version: _Optional[int] = ..., tensor_broadcasts: _Optional[bool] = ..., needs_full: _Optional[bool] = ..., partial_updates: _Optional[bool] = ...) -> None: ...

class CommitUpdateRequest(_message.Message):
    __slots__ = ("version", "timeout_s", "reset_prefix_cache")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RESET_PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    version: int
    timeout_s: float
    reset_prefix_cache: bool
    def __init__(self, version: _Optional[int] = ..., timeout_s: _Optional[float] = ..., reset_prefix_cache: _Optional[bool] = ...) -> None: ...

class CommitUpdateResponse(_message.Message):
    __slots__ = ("current_version", "receive_s", "switch_s", "pause_s")
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RECEIVE_S_FIELD_NUMBER: _ClassVar[int]
    SWITCH_S_FIELD_NUMBER: _ClassVar[int]
    PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    receive_s: float
    switch_s: float
    pause_s: float
    def __init__(self, current_version: _Optional[int] = ..., receive_s: _Optional[float] = ..., switch_s: _Optional[float] = ..., pause_s: _Optional[float] = ...) -> None: ...

class AbortUpdateRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class AbortUpdateResponse(_message.Message):
    __slots__ = ("current_version",)
    CURRENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    current_version: int
    def __init__(self, current_version: _Optional[int] = ...) -> None: ...
