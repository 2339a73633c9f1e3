"""What the rollout service's RPCs share with the session RPCs, the decode worker and the router: the service's
name, the finish reasons and refusal codes on the wire, and the count of tokens sent."""

import grpc
from prometheus_client import Counter

from protos import common_pb2, rollout_pb2
from protos.codec import encode_array, encode_tensor
from rollout.engine.errors import DuplicateRequest, InvalidRequest, QueueFull
from rollout.engine.sequence import FinishReason

SERVICE_NAME = rollout_pb2.DESCRIPTOR.services_by_name["Rollout"].full_name  # relayrl.rollout.v1.Rollout

TOKENS_GENERATED = Counter("relayrl_rollout_generated_tokens_total", "Tokens generated and sent to clients")

FINISH_REASONS = {
    None: rollout_pb2.FINISH_REASON_NONE,
    FinishReason.STOP: rollout_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: rollout_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: rollout_pb2.FINISH_REASON_ABORT,
}

REFUSAL_CODES = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (QueueFull, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (DuplicateRequest, grpc.StatusCode.ALREADY_EXISTS),
)


def generate_chunk(request_id: str, delta, with_logprobs: bool, text: str) -> rollout_pb2.GenerateChunk:
    """One streamed delta of a completion (rollout.engine.outputs.Completion) as it goes on the wire."""
    return rollout_pb2.GenerateChunk(
        request_id=request_id,
        index=delta.index,
        token_ids=encode_array(delta.token_ids, "int32"),
        logprobs=encode_array(delta.logprobs if with_logprobs else [], "float32"),
        weight_versions=encode_array(delta.weight_versions, "int64"),
        finish_reason=FINISH_REASONS[delta.finish_reason],
        text=text,
        kv_version=delta.kv_version,
        routed_experts=routes_array(delta.routed_experts),
    )


def routes_array(routes) -> common_pb2.Array | None:
    """A completion's routed experts (np.ndarray [tokens, layers, top_k]) on the wire; None: not recorded."""
    return encode_tensor(routes, routes.dtype) if routes is not None else None
