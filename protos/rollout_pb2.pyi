from protos import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_NONE: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_NONE: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "max_tokens", "stop_token_ids", "stop", "n", "seed", "logprobs", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    n: int
    seed: int
    logprobs: bool
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., n: _Optional[int] = ..., seed: _Optional[int] = ..., logprobs: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_ids", "prompt_text", "params", "routing_key", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    ROUTING_KEY_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_ids: _common_pb2.Array
    prompt_text: str
    params: SamplingParams
    routing_key: str
    images: _containers.RepeatedCompositeFieldContainer[ImagePart]
    def __init__(self, request_id: _Optional[str] = ..., prompt_ids: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., prompt_text: _Optional[str] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., routing_key: _Optional[str] = ..., images: _Optional[_Iterable[_Union[ImagePart, _Mapping]]] = ...) -> None: ...

class ImagePart(_message.Message):
    __slots__ = ("data", "media_type", "sha256", "uri")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MEDIA_TYPE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    URI_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    media_type: str
    sha256: bytes
    uri: str
    def __init__(self, data: _Optional[bytes] = ..., media_type: _Optional[str] = ..., sha256: _Optional[bytes] = ..., uri: _Optional[str] = ...) -> None: ...

class Completion(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "weight_versions", "finish_reason", "text", "logprobs_temperature", "kv_version", "routed_experts")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    KV_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _common_pb2.Array
    logprobs: _common_pb2.Array
    weight_versions: _common_pb2.Array
    finish_reason: FinishReason
    text: str
    logprobs_temperature: float
    kv_version: int
    routed_experts: _common_pb2.Array
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., weight_versions: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., text: _Optional[str] = ..., logprobs_temperature: _Optional[float] = ..., kv_version: _Optional[int] = ..., routed_experts: _Optional[_Union[_common_pb2.Array, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "completions", "prompt_tokens", "prompt_ids", "images")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    completions: _containers.RepeatedCompositeFieldContainer[Completion]
    prompt_tokens: int
    prompt_ids: _common_pb2.Array
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageRef]
    def __init__(self, request_id: _Optional[str] = ..., completions: _Optional[_Iterable[_Union[Completion, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ..., prompt_ids: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageRef, _Mapping]]] = ...) -> None: ...

class GenerateManyRequest(_message.Message):
    __slots__ = ("requests",)
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateRequest]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateRequest, _Mapping]]] = ...) -> None: ...

class GenerateManyResponse(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[GenerateResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[GenerateResponse, _Mapping]]] = ...) -> None: ...

class GenerateChunk(_message.Message):
    __slots__ = ("request_id", "index", "token_ids", "logprobs", "weight_versions", "finish_reason", "text", "kv_version", "routed_experts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    KV_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    index: int
    token_ids: _common_pb2.Array
    logprobs: _common_pb2.Array
    weight_versions: _common_pb2.Array
    finish_reason: FinishReason
    text: str
    kv_version: int
    routed_experts: _common_pb2.Array
    def __init__(self, request_id: _Optional[str] = ..., index: _Optional[int] = ..., token_ids: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., logprobs: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., weight_versions: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., text: _Optional[str] = ..., kv_version: _Optional[int] = ..., routed_experts: _Optional[_Union[_common_pb2.Array, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetWeightVersionRequest(_message.Message):
    __slots__ = ("newer_than", "wait_s")
    NEWER_THAN_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    newer_than: int
    wait_s: float
    def __init__(self, newer_than: _Optional[int] = ..., wait_s: _Optional[float] = ...) -> None: ...

class GetWeightVersionResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("model", "vocab_size", "max_model_len", "weight_version", "paused", "eos_token_id", "engine")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    model: str
    vocab_size: int
    max_model_len: int
    weight_version: int
    paused: bool
    eos_token_id: int
    engine: str
    def __init__(self, model: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., weight_version: _Optional[int] = ..., paused: _Optional[bool] = ..., eos_token_id: _Optional[int] = ..., engine: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "prompt_text", "messages", "add_bos", "images")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_BOS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _common_pb2.Array
    prompt_text: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_bos: bool
    images: _containers.RepeatedCompositeFieldContainer[ImagePart]
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., prompt_text: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_bos: _Optional[bool] = ..., images: _Optional[_Iterable[_Union[ImagePart, _Mapping]]] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "num_tokens", "token_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_tokens: int
    token_ids: _common_pb2.Array
    def __init__(self, session_id: _Optional[str] = ..., num_tokens: _Optional[int] = ..., token_ids: _Optional[_Union[_common_pb2.Array, _Mapping]] = ...) -> None: ...

class AppendToSessionRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "text", "turn_reward", "messages", "images")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TURN_REWARD_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _common_pb2.Array
    text: str
    turn_reward: float
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    images: _containers.RepeatedCompositeFieldContainer[ImagePart]
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., text: _Optional[str] = ..., turn_reward: _Optional[float] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., images: _Optional[_Iterable[_Union[ImagePart, _Mapping]]] = ...) -> None: ...

class AppendToSessionResponse(_message.Message):
    __slots__ = ("num_tokens", "token_ids")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    token_ids: _common_pb2.Array
    def __init__(self, num_tokens: _Optional[int] = ..., token_ids: _Optional[_Union[_common_pb2.Array, _Mapping]] = ...) -> None: ...

class GenerateInSessionRequest(_message.Message):
    __slots__ = ("session_id", "params", "whole_turn", "expected_idle_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    WHOLE_TURN_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_IDLE_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    params: SamplingParams
    whole_turn: bool
    expected_idle_s: float
    def __init__(self, session_id: _Optional[str] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., whole_turn: _Optional[bool] = ..., expected_idle_s: _Optional[float] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id", "reward", "submit", "group_id", "group_size", "prompt_id", "sample_id", "reward_details", "metadata")
    class RewardDetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_DETAILS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    reward: float
    submit: bool
    group_id: str
    group_size: int
    prompt_id: str
    sample_id: str
    reward_details: _containers.ScalarMap[str, float]
    metadata: bytes
    def __init__(self, session_id: _Optional[str] = ..., reward: _Optional[float] = ..., submit: _Optional[bool] = ..., group_id: _Optional[str] = ..., group_size: _Optional[int] = ..., prompt_id: _Optional[str] = ..., sample_id: _Optional[str] = ..., reward_details: _Optional[_Mapping[str, float]] = ..., metadata: _Optional[bytes] = ...) -> None: ...

class SessionStats(_message.Message):
    __slots__ = ("turns", "prefill_tokens", "turn_prefill_tokens", "kv_recomputes")
    TURNS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TURN_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_RECOMPUTES_FIELD_NUMBER: _ClassVar[int]
    turns: int
    prefill_tokens: int
    turn_prefill_tokens: _containers.RepeatedScalarFieldContainer[int]
    kv_recomputes: int
    def __init__(self, turns: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., turn_prefill_tokens: _Optional[_Iterable[int]] = ..., kv_recomputes: _Optional[int] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("sample", "submitted", "stats")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    sample: _common_pb2.Sample
    submitted: bool
    stats: SessionStats
    def __init__(self, sample: _Optional[_Union[_common_pb2.Sample, _Mapping]] = ..., submitted: _Optional[bool] = ..., stats: _Optional[_Union[SessionStats, _Mapping]] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("prompt_ids", "response_ids", "temperature", "images")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _common_pb2.Array
    response_ids: _containers.RepeatedCompositeFieldContainer[_common_pb2.Array]
    temperature: float
    images: _containers.RepeatedCompositeFieldContainer[ImagePart]
    def __init__(self, prompt_ids: _Optional[_Union[_common_pb2.Array, _Mapping]] = ..., response_ids: _Optional[_Iterable[_Union[_common_pb2.Array, _Mapping]]] = ..., temperature: _Optional[float] = ..., images: _Optional[_Iterable[_Union[ImagePart, _Mapping]]] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("logprobs", "weight_version")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.Array]
    weight_version: int
    def __init__(self, logprobs: _Optional[_Iterable[_Union[_common_pb2.Array, _Mapping]]] = ..., weight_version: _Optional[int] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("free_blocks", "num_blocks", "running", "waiting", "weight_version", "sessions", "openai_port")
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OPENAI_PORT_FIELD_NUMBER: _ClassVar[int]
    free_blocks: int
    num_blocks: int
    running: int
    waiting: int
    weight_version: int
    sessions: int
    openai_port: int
    def __init__(self, free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., weight_version: _Optional[int] = ..., sessions: _Optional[int] = ..., openai_port: _Optional[int] = ...) -> None: ...
