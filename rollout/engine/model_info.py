"""What an engine tells its callers about the model it serves: its facts, and the layout of its weights."""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

Layout = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class ModelInfo:
    """What callers need to know about the served model and how the engine reports logprobs."""

    engine: str  # "native", "vllm", "sglang" (GetModelInfo.engine)
    vocab_size: int
    max_model_len: int  # prompt + response limit
    eos_token_ids: tuple[int, ...]
    logprobs_mode: str  # "tempered" / "raw" / "processed" (rollout.engine.sampling_params.logprobs_temperature)
    session_idle_timeout_s: float  # an idle session is closed after this long
