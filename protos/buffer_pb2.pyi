from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Policy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POLICY_UNSPECIFIED: _ClassVar[Policy]
    POLICY_FIFO: _ClassVar[Policy]
    POLICY_UNIFORM: _ClassVar[Policy]
POLICY_UNSPECIFIED: Policy
POLICY_FIFO: Policy
POLICY_UNIFORM: Policy

class PutRequest(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("accepted", "duplicates")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    accepted: int
    duplicates: int
    def __init__(self, accepted: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("batch_size", "allow_partial_groups", "max_batches", "lease_timeout_s", "policy", "max_reuse", "consumer", "max_unacked", "trainer_version")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ALLOW_PARTIAL_GROUPS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCHES_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    MAX_REUSE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    MAX_UNACKED_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    allow_partial_groups: bool
    max_batches: int
    lease_timeout_s: float
    policy: Policy
    max_reuse: int
    consumer: str
    max_unacked: int
    trainer_version: int
    def __init__(self, batch_size: _Optional[int] = ..., allow_partial_groups: _Optional[bool] = ..., max_batches: _Optional[int] = ..., lease_timeout_s: _Optional[float] = ..., policy: _Optional[_Union[Policy, str]] = ..., max_reuse: _Optional[int] = ..., consumer: _Optional[str] = ..., max_unacked: _Optional[int] = ..., trainer_version: _Optional[int] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("lease_id", "samples", "trainer_version")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    trainer_version: int
    def __init__(self, lease_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ..., trainer_version: _Optional[int] = ...) -> None: ...

class AckRequest(_message.Message):
    __slots__ = ("lease_id", "trainer_version")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    trainer_version: int
    def __init__(self, lease_id: _Optional[str] = ..., trainer_version: _Optional[int] = ...) -> None: ...

class AckResponse(_message.Message):
    __slots__ = ("acked",)
    ACKED_FIELD_NUMBER: _ClassVar[int]
    acked: int
    def __init__(self, acked: _Optional[int] = ...) -> None: ...

class ExtendLeaseRequest(_message.Message):
    __slots__ = ("lease_ids", "lease_timeout_s", "consumed", "trainer_version")
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_timeout_s: float
    consumed: bool
    trainer_version: int
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ..., lease_timeout_s: _Optional[float] = ..., consumed: _Optional[bool] = ..., trainer_version: _Optional[int] = ...) -> None: ...

class ExtendLeaseResponse(_message.Message):
    __slots__ = ("extended", "missing")
    EXTENDED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    extended: int
    missing: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, extended: _Optional[int] = ..., missing: _Optional[_Iterable[str]] = ...) -> None: ...

class SetVersionRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class SetVersionResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("pending", "leased", "acked", "dropped", "capacity", "accepted", "trainer_version", "max_staleness", "redelivered", "duplicates", "consumed")
    class DroppedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PENDING_FIELD_NUMBER: _ClassVar[int]
    LEASED_FIELD_NUMBER: _ClassVar[int]
    ACKED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TRAINER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_STALENESS_FIELD_NUMBER: _ClassVar[int]
    REDELIVERED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    CONSUMED_FIELD_NUMBER: _ClassVar[int]
    pending: int
    leased: int
    acked: int
    dropped: _containers.ScalarMap[str, int]
    capacity: int
    accepted: int
    trainer_version: int
    max_staleness: int
    redelivered: int
    duplicates: int
    consumed: int
    def __init__(self, pending: _Optional[int] = ..., leased: _Optional[int] = ..., acked: _Optional[int] = ..., dropped: _Optional[_Mapping[str, int]] = ..., capacity: _Optional[int] = ..., accepted: _Optional[int] = ..., trainer_version: _Optional[int] = ..., max_staleness: _Optional[int] = ..., redelivered: _Optional[int] = ..., duplicates: _Optional[int] = ..., consumed: _Optional[int] = ...) -> None: ...
