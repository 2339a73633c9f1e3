from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REPLICA_STATE_JOINING: _ClassVar[ReplicaState]
    REPLICA_STATE_ACTIVE: _ClassVar[ReplicaState]
    REPLICA_STATE_DRAINING: _ClassVar[ReplicaState]
REPLICA_STATE_UNSPECIFIED: ReplicaState
REPLICA_STATE_JOINING: ReplicaState
REPLICA_STATE_ACTIVE: ReplicaState
REPLICA_STATE_DRAINING: ReplicaState

class AddReplicaRequest(_message.Message):
    __slots__ = ("address", "wait_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    wait_s: float
    def __init__(self, address: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class RemoveReplicaRequest(_message.Message):
    __slots__ = ("address", "drain_timeout_s")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    address: str
    drain_timeout_s: float
    def __init__(self, address: _Optional[str] = ..., drain_timeout_s: _Optional[float] = ...) -> None: ...

class RemoveReplicaResponse(_message.Message):
    __slots__ = ("drained", "in_flight", "sessions")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    in_flight: int
    sessions: int
    def __init__(self, drained: _Optional[bool] = ..., in_flight: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class ListReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("address", "state", "alive", "weight_version", "in_flight", "running", "waiting", "sessions")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ALIVE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    address: str
    state: ReplicaState
    alive: bool
    weight_version: int
    in_flight: int
    running: int
    waiting: int
    sessions: int
    def __init__(self, address: _Optional[str] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., alive: _Optional[bool] = ..., weight_version: _Optional[int] = ..., in_flight: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class ListReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ...) -> None: ...
