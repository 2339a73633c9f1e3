"""What the engine hands back: per-step token outputs and, for offline use, whole completions."""

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rollout.engine.sequence import FinishReason


class TokenOutput(NamedTuple):
    """What one step produced for one completion: a new token, or only its end (abort).

    A NamedTuple rather than a frozen dataclass: the engine makes one per sequence per step, and a
    frozen dataclass's __init__ costs about twice as much (~2.9 vs ~1.3 us measured here).
    """

    request_id: str
    index: int  # completion index within the request
    token_id: int | None  # None for an abort, which produces no token
    logprob: float | None
    weight_version: int | None  # policy version that produced the token
    finish_reason: FinishReason | None  # None while the completion continues
    kv_version: int | None = None  # on a completion's last output: Sequence.kv_version (None: unknown)
    # On a completion's last output, of a mixture-of-experts model: Sequence.routed_experts (None: not recorded)
    routed_experts: Any = None


@dataclass
class Completion:
    """One completion as it stands (finished when finish_reason is set)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # Once finished: the oldest weight version of the KV its tokens were sampled on (Sequence.kv_version);
    # None: unknown (the engine does not say, or no KV was computed)
    kv_version: int | None = None
    # Once finished, of a mixture-of-experts model: the experts each token of prompt + completion but the last was
    # routed to, np.ndarray [tokens, layers, top_k] (Sequence.routed_experts); None: not recorded
    routed_experts: Any = None
    # Once finished, from a whole delivery: its times in ns since the epoch, [arrival, first scheduled, first token,
    # finished] (Sequence.timing; a traced request's engine spans); None: not kept
    timing: list[int | None] | None = field(default=None, compare=False, repr=False)  # not the completion's content

    def add(self, output: TokenOutput) -> None:
        if output.token_id is not None:
            self.token_ids.append(output.token_id)
            self.logprobs.append(output.logprob)
            self.weight_versions.append(output.weight_version)
        self.finish_reason = output.finish_reason
        self.kv_version = output.kv_version
        self.routed_experts = output.routed_experts


@dataclass
class RequestOutput:
    """A request's prompt and its n completions, ordered by index."""

    request_id: str
    prompt_ids: list[int]
    completions: list[Completion]
