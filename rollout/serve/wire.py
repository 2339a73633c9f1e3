"""What the rollout service's RPCs share with the session RPCs, the decode worker and the router: the service's
name, the finish reasons and refusal codes on the wire, and the count of tokens sent."""

import grpc
from prometheus_client import Counter

from protos import rollout_pb2
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
