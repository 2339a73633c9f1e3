"""Samples for the buffer tests: what a driver would Put, with the fields the buffer reads."""

import numpy as np

from protos import common_pb2
from protos.sample import Sample, SampleStatus


def sample_proto(sample_id: str, group: str = "", size: int = 0, version: int = 0, tokens: int = 8,
                 status: SampleStatus = SampleStatus.COMPLETED) -> common_pb2.Sample:
    """A sample of `tokens` response tokens made by weight `version`, in group `group` of `size`."""
    return Sample(
        sample_id=sample_id,
        prompt_id=group or sample_id,
        group_id=group,
        group_size=size,
        prompt_ids=np.arange(4, dtype=np.int32),
        response_ids=np.arange(tokens, dtype=np.int32),
        loss_mask=np.ones(tokens, dtype=np.uint8),
        rollout_logprobs=np.full(tokens, -0.5, dtype=np.float32),
        weight_versions=np.full(tokens, version, dtype=np.int64),
        status=status,
    ).to_proto()
