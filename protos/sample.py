"""The one sample type: a trajectory as every stage sees it, and its wire form."""

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from protos import common_pb2
from protos.codec import (
    CodecError,
    decode_array,
    decode_tensor,
    encode_array,
    encode_tensor,
    pack_metadata,
    unpack_metadata,
)

ROUTE_DTYPES = ("uint8", "uint16")  # of routed_experts: uint16 for models with more than 256 experts


class SampleStatus(enum.IntEnum):
    COMPLETED = common_pb2.SAMPLE_STATUS_COMPLETED
    TRUNCATED = common_pb2.SAMPLE_STATUS_TRUNCATED
    ABORTED = common_pb2.SAMPLE_STATUS_ABORTED
    FAILED = common_pb2.SAMPLE_STATUS_FAILED


def _empty(dtype: str) -> np.ndarray:
    return np.empty(0, dtype=dtype)


@dataclass(frozen=True)
class SampleImage:
    """One image of a sample's prompt (common.proto's ImageRef): its identity, the patch grid the rollout's image
    processor made and its token count in the prompt, and the encoded bytes."""

    sha256: bytes
    media_type: str
    grid_thw: tuple[int, int, int]
    num_tokens: int
    data: bytes = b""

    def to_proto(self) -> common_pb2.ImageRef:
        return common_pb2.ImageRef(sha256=self.sha256, media_type=self.media_type, grid_thw=list(self.grid_thw),
                                   num_tokens=self.num_tokens, data=self.data)

    @classmethod
    def from_proto(cls, msg: common_pb2.ImageRef, index: int) -> "SampleImage":
        if len(msg.grid_thw) != 3:
            raise CodecError(f"images[{index}].grid_thw: expected 3 numbers (t, h, w), got {len(msg.grid_thw)}")
        return cls(msg.sha256, msg.media_type, tuple(msg.grid_thw), msg.num_tokens, msg.data)


@dataclass
class Sample:
    """One response to one prompt, with everything training needs.

    Per-token arrays (loss_mask, rollout_logprobs, weight_versions and the optional
    ref_logprobs/values/advantages) run over response_ids.
    """

    sample_id: str
    prompt_id: str
    prompt_ids: np.ndarray  # int32
    response_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # uint8, 1 = trained on
    rollout_logprobs: np.ndarray  # float32
    weight_versions: np.ndarray  # int64
    group_id: str = ""
    group_size: int = 0
    reward: float = 0.0
    reward_details: dict[str, float] = field(default_factory=dict)
    turn_rewards: np.ndarray = field(default_factory=lambda: _empty("float32"))
    status: SampleStatus = SampleStatus.COMPLETED
    reason: str = ""
    prompt_text: str = ""
    response_text: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    ref_logprobs: np.ndarray = field(default_factory=lambda: _empty("float32"))
    values: np.ndarray = field(default_factory=lambda: _empty("float32"))
    advantages: np.ndarray = field(default_factory=lambda: _empty("float32"))
    # rollout_logprobs are of softmax(logits / temperature); 0 = unset, the raw distribution (1.0)
    temperature: float = 0.0
    # The oldest weight version of the KV its tokens were sampled on (common.proto says exactly what it bounds: a
    # token of version w attended to KV of versions in [min(w, kv_version), w]); None: the producer does not know
    kv_version: int | None = None
    # Routing replay (R3): the experts each token of prompt_ids + response_ids was routed to by the rollout engine,
    # [tokens, sparse layers, top_k] uint8/uint16, over all tokens or all but the last (common.proto says exactly);
    # empty (shape [0, 0, 0]): not recorded
    routed_experts: np.ndarray = field(default_factory=lambda: Sample.routed_experts_unset())
    # The prompt's images, in order (a vision-language model); [] for text
    images: list[SampleImage] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.group_id:
            self.group_id = self.prompt_id

    @staticmethod
    def routed_experts_unset() -> np.ndarray:
        """routed_experts when not recorded."""
        return np.empty((0, 0, 0), np.uint8)

    @property
    def oldest_version(self) -> int:
        """The oldest policy version that produced a trained-on token (-1 if none)."""
        versions = self.weight_versions[self.loss_mask.astype(bool)] if self.loss_mask.size else self.weight_versions
        return int(versions.min()) if versions.size else -1

    def validate(self) -> None:
        """Raise CodecError naming the field when the sample is inconsistent."""
        if not self.sample_id:
            raise CodecError("sample_id: must not be empty")
        if not self.prompt_id:
            raise CodecError("prompt_id: must not be empty")
        n = self.response_ids.size
        for name in ("loss_mask", "rollout_logprobs", "weight_versions"):
            if getattr(self, name).size != n:
                raise CodecError(f"{name}: has {getattr(self, name).size} entries for {n} response tokens")
        if not self.temperature >= 0:  # NaN too
            raise CodecError(f"temperature: must be >= 0, got {self.temperature}")
        for name in ("ref_logprobs", "values", "advantages"):
            size = getattr(self, name).size
            if size not in (0, n):
                raise CodecError(f"{name}: has {size} entries for {n} response tokens")
        routes, total = self.routed_experts, self.prompt_ids.size + n
        if routes.ndim != 3 or routes.dtype.name not in ROUTE_DTYPES:
            raise CodecError(f"routed_experts: must be [tokens, layers, top_k] uint8/uint16, got {routes.dtype.name} "
                             f"of shape {list(routes.shape)}")
        if routes.shape[0] and not total - 1 <= routes.shape[0] <= total:
            raise CodecError(f"routed_experts: has {routes.shape[0]} rows for {total} tokens (prompt + response; "
                             "all of them or all but the last)")

    def to_proto(self) -> common_pb2.Sample:
        return common_pb2.Sample(
            sample_id=self.sample_id,
            prompt_id=self.prompt_id,
            group_id=self.group_id,
            group_size=self.group_size,
            prompt_ids=encode_array(self.prompt_ids, "int32"),
            response_ids=encode_array(self.response_ids, "int32"),
            loss_mask=encode_array(self.loss_mask, "uint8"),
            rollout_logprobs=encode_array(self.rollout_logprobs, "float32"),
            weight_versions=encode_array(self.weight_versions, "int64"),
            reward=self.reward,
            reward_details=self.reward_details,
            turn_rewards=encode_array(self.turn_rewards, "float32"),
            status=int(self.status),
            reason=self.reason,
            prompt_text=self.prompt_text,
            response_text=self.response_text,
            metadata=pack_metadata(self.metadata),
            ref_logprobs=encode_array(self.ref_logprobs, "float32"),
            values=encode_array(self.values, "float32"),
            advantages=encode_array(self.advantages, "float32"),
            temperature=self.temperature,
            kv_version=self.kv_version,
            routed_experts=encode_tensor(self.routed_experts, self.routed_experts.dtype),
            images=[image.to_proto() for image in self.images],
        )

    @classmethod
    def from_proto(cls, msg: common_pb2.Sample) -> "Sample":
        """Decode and validate; raises CodecError naming the bad field."""
        if msg.status not in SampleStatus._value2member_map_:
            raise CodecError(f"status: unknown value {msg.status}")

        def arr(name: str, dtype: str) -> np.ndarray:
            return decode_array(getattr(msg, name), field=name, expect=dtype)

        sample = cls(
            sample_id=msg.sample_id,
            prompt_id=msg.prompt_id,
            group_id=msg.group_id,
            group_size=msg.group_size,
            prompt_ids=arr("prompt_ids", "int32"),
            response_ids=arr("response_ids", "int32"),
            loss_mask=arr("loss_mask", "uint8"),
            rollout_logprobs=arr("rollout_logprobs", "float32"),
            weight_versions=arr("weight_versions", "int64"),
            reward=msg.reward,
            reward_details=dict(msg.reward_details),
            turn_rewards=arr("turn_rewards", "float32"),
            status=SampleStatus(msg.status),
            reason=msg.reason,
            prompt_text=msg.prompt_text,
            response_text=msg.response_text,
            metadata=unpack_metadata(msg.metadata),
            ref_logprobs=arr("ref_logprobs", "float32"),
            values=arr("values", "float32"),
            advantages=arr("advantages", "float32"),
            temperature=msg.temperature,
            kv_version=msg.kv_version if msg.HasField("kv_version") else None,
            routed_experts=decode_tensor(msg.routed_experts, "routed_experts", ROUTE_DTYPES, 3),
            images=[SampleImage.from_proto(image, i) for i, image in enumerate(msg.images)],
        )
        sample.validate()
        return sample
