"""Per-request sampling controls and their validation against the engine's limits."""

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rollout.engine.errors import InvalidRequest

LOGPROBS_MODES = ("tempered", "raw", "processed")  # see rollout/engine/sampler.py


def logprobs_temperature(mode: str, temperature: float) -> float:
    """The temperature T whose softmax(logits / T) a sampled token's reported logprob is of (1.0: raw)."""
    return temperature if mode != "raw" and temperature > 0 else 1.0


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of one prompt.

    temperature 0 is greedy. top_k 0 or -1 keeps every token. Without a seed the engine draws one,
    so every completion is reproducible from (seed, completion index, position).
    """

    temperature: float = 1.0
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 or -1: all
    max_tokens: int = 16  # new tokens per completion, > 0
    stop_token_ids: tuple[int, ...] = ()  # end a completion, besides eos
    stop: tuple[str, ...] = ()  # strings that end a completion (matched on the decoded response)
    n: int = 1  # completions of the prompt; they share the prompt's KV blocks
    seed: int | None = None  # per-request seed
    ignore_eos: bool = False  # do not stop at eos

    def validate(self, *, prompt_len: int, vocab_size: int, max_model_len: int, max_n: int) -> None:
        """Raise InvalidRequest naming the field ("params.top_p", ...) when a value is out of range."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise InvalidRequest("params.temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidRequest("params.top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequest("params.top_k", f"must be -1, 0 or positive, got {self.top_k}")
        if self.max_tokens <= 0:
            raise InvalidRequest("params.max_tokens", f"must be > 0, got {self.max_tokens}")
        if prompt_len + self.max_tokens > max_model_len:
            raise InvalidRequest(
                "params.max_tokens",
                f"prompt ({prompt_len} tokens) + max_tokens ({self.max_tokens}) exceeds the context length {max_model_len}",
            )
        if not 1 <= self.n <= max_n:
            raise InvalidRequest("params.n", f"must be in [1, {max_n}], got {self.n}")
        bad_stops = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad_stops:
            raise InvalidRequest("params.stop_token_ids", f"ids {bad_stops} are outside the vocabulary [0, {vocab_size})")
        if any(not s for s in self.stop):
            raise InvalidRequest("params.stop", "stop strings must not be empty")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise InvalidRequest("params.seed", f"must be in [0, 2**64), got {self.seed}")


def validate_prompt(prompt_ids: Sequence[int], vocab_size: int, field: str = "prompt_ids") -> None:
    """Raise InvalidRequest when the prompt is empty or holds ids outside [0, vocab_size)."""
    if len(prompt_ids) == 0:
        raise InvalidRequest(field, "must not be empty")
    low, high = min(prompt_ids), max(prompt_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InvalidRequest(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")
