"""One completion being generated: its tokens, KV block table, and what it has produced."""

import enum
import time

from rollout.engine.multimodal import MultimodalPrompt
from rollout.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # aborted; the partial output is kept


def oldest(*versions: int | None) -> int | None:
    """The smallest of the versions that are not None (None if all are)."""
    known = [v for v in versions if v is not None]
    return min(known) if known else None


class Sequence:
    """Completion `index` of request `request_id`.

    `token_ids` holds prompt then output tokens. `num_cached_tokens` of them have their KV in the
    blocks of `block_table`; between steps a decoding sequence has every token cached but the last
    (the one it sampled), which the next decode step feeds in. From the step that starts it until the
    step that computes its last token, a sequence is `prefilling`: it computes its uncached tokens in
    chunks and samples nothing.
    """

    def __init__(self, seq_id: int, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams, seed: int):
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.params = params
        self.seed = seed
        self.token_ids = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix hashes of its full blocks of tokens (BlockManager.prefix_hashes)
        self.num_registered_blocks = 0  # leading blocks of block_table offered to the prefix cache
        self.prefilling = False
        # Tokens whose KV was evicted (rollout/engine/kv_eviction.py): the token at position p sits in cache slot
        # p - num_evicted_tokens of block_table (positions stay the model's; keys carry their RoPE).
        self.num_evicted_tokens = 0
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.logprobs: list[float] = []
        self.weight_versions: list[int] = []
        # n > 1: the other completions wait attached to completion 0 until the step that completes its
        # prefill, where they fork its prompt blocks; `prefill_from` then points at the sibling whose
        # logits they sample.
        self.forks: list[Sequence] = []
        self.prefill_from: Sequence | None = None
        # A session's turn (rollout/engine/sessions.py): its blocks go back to the session when it finishes.
        self.session = None
        # The weight versions of its KV (kv_version below). `context_version`: the version its oldest KV was
        # computed with; None while it holds none (the engine step that computes its first KV sets it).
        # `stale_kv_version`: the oldest context_version a token was sampled on with newer weights, if one was.
        self.context_version: int | None = None
        self.stale_kv_version: int | None = None
        # The weight version it samples with: the engine's when it was made; a weight update moves it to the new one,
        # unless it serves LoRA unmerged and this version stays resident (rollout/engine/adapter_pins.py)
        self.policy_version = 0
        # Of a mixture-of-experts model: the experts each position was routed to (rollout/engine/routes.py's RouteLog)
        self.routes = None
        # The images of its prompt and their M-RoPE positions (rollout/engine/multimodal.py); None: text only.
        self.multimodal: MultimodalPrompt | None = None
        # ns since the epoch: [arrival, first scheduled, first token, finished] (rollout/engine/step_stats.py)
        self.timing: list[int | None] = [time.time_ns(), None, None, None]

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncached_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def num_slots(self) -> int:
        """Cache slots its tokens need: its tokens less the evicted ones."""
        return len(self.token_ids) - self.num_evicted_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def kv_version(self) -> int | None:
        """The oldest weight version of the KV its tokens were sampled on, where that KV is older than the token's
        own weights, or else of the KV it holds: a token of weight version w was sampled on KV computed with
        versions in [min(w, kv_version), w]. None: it computed no KV."""
        return oldest(self.context_version, self.stale_kv_version)

    @property
    def routed_experts(self):
        """The routes of every position but the last (np.ndarray [len - 1, layers, top_k]); None when not recorded."""
        return self.routes.prefix(len(self.token_ids) - 1) if self.routes is not None else None

    def append(self, token_id: int, logprob: float, weight_version: int) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.weight_versions.append(weight_version)
        if self.context_version != weight_version:  # sampled on KV of older weights (kv_on_update keep)
            self.stale_kv_version = oldest(self.stale_kv_version, self.context_version)

