"""Token sampling for a batch: temperature, top-k, top-p, greedy, per-request seeds, logprobs.

Sampling is Gumbel-max over the processed logits: token = argmax(logits / T (top-k/top-p
masked) + Gumbel noise). The noise comes from a counter-based hash of (seed, completion index,
position, token id) (splitmix64), so one batched op serves every request, each with its own seed, and a
completion is reproducible whatever it was batched with and even after preemption.

The [B, V] work that needs int64 (the hash, top-k/top-p's sort indices) runs on a few rows at a time, at most
`chunk_elements` elements (32 MB of int64 by default), and the noise is float32 from 23 bits of the hash: at
B = 256 and Qwen's V = 151,936 a [B, V] int64 or float64 temporary alone is 311 MB. The rows a chunk takes
do not change any row's draw (the noise is a pure function of its row key and token id).

Logprobs (`logprobs_mode`):
- "tempered" (default): log_softmax(logits / T) at the row's temperature T, before top-k/top-p: the
  distribution the token was drawn from, up to the truncation. The trainer recomputes exactly this
  (Sample.temperature carries T), so the PPO ratio and the importance weights compare like with like.
  Greedy rows (T = 0) report the raw logprob (T = 1). top-k/top-p are not in the number: the trainer
  cannot reproduce a truncation (verl and vLLM's default make the same choice); a truncated sampler is
  corrected only up to the mass it cuts, which `top_p: 1, top_k: 0` (the default) makes zero.
- "raw": log_softmax of the logits at temperature 1 whatever T was (what the policy would score at T = 1).
- "processed": log-probability under the distribution actually sampled from (after temperature,
  top-k and top-p); 0.0 for greedy rows, whose distribution is a point mass. Not reproducible by the
  trainer when top-k/top-p cut anything: for inspection, not for off-policy correction.
"""

import functools
from dataclasses import dataclass

import torch

from rollout.engine.sampling_params import LOGPROBS_MODES


def as_int64(value: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic; products wrap alike)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment and finaliser constants
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def splitmix64(value: int) -> int:
    """The splitmix64 finaliser on a Python int (the per-row half of the hash, computed host-side)."""
    value = (value ^ (value >> 30)) * _MIX1 & _MASK64
    value = (value ^ (value >> 27)) * _MIX2 & _MASK64
    return value ^ (value >> 31)


@functools.lru_cache(maxsize=4096)
def completion_key(seed: int, index: int) -> int:
    """The per-completion half of row_key, the same at every position (cached: it is asked every step)."""
    return splitmix64((splitmix64(seed) + index) & _MASK64)


def row_key(seed: int, index: int, position: int) -> int:
    """The noise key of one sampled token: completion `index` of a request seeded `seed`, at `position`."""
    return as_int64(splitmix64((completion_key(seed, index) + position) & _MASK64))


def row_keys(completion_keys: list[int], positions: list[int]) -> list[int]:
    """row_key of each (completion_key(seed, index), position) pair, as int64 values (hashed on the host: a few
    hundred rows cost microseconds, and the step's int64 controls then travel in one copy)."""
    return [as_int64(splitmix64((key + position) & _MASK64)) for key, position in zip(completion_keys, positions)]


@dataclass
class SamplingTensors:
    """Per-row sampling controls of one batch, as tensors on the logits' device."""

    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, vocab size when unrestricted
    row_keys: torch.Tensor  # [B] int64, row_key(seed, completion index, position)
    any_sampled: bool  # some row has temperature > 0
    any_filtered: bool  # some sampled row uses top-k or top-p


CHUNK_ELEMENTS = 1 << 22  # elements of the [rows, V] int64 temporaries a chunk of rows may hold


class Sampler:
    def __init__(self, logprobs_mode: str = "tempered", chunk_elements: int = CHUNK_ELEMENTS):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode: expected one of {LOGPROBS_MODES}, got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode
        self.chunk_elements = chunk_elements
        self._token_offsets: torch.Tensor | None = None  # token id * golden ratio, per vocabulary

    def _chunks(self, batch: int, vocab: int) -> list[slice]:
        """Row ranges of at most chunk_elements elements of [batch, vocab] (one row at the least)."""
        step = max(1, self.chunk_elements // vocab)
        return [slice(start, start + step) for start in range(0, batch, step)]

    def _noisy_argmax(self, scores: torch.Tensor, row_keys: torch.Tensor) -> torch.Tensor:
        """argmax(scores + Gumbel(0, 1) noise) of each row of scores [B, V]; the noise, a pure function of (row key,
        token id), is made a chunk of rows at a time."""
        batch, vocab = scores.shape
        if self._token_offsets is None or self._token_offsets.shape[1] != vocab:
            ids = torch.arange(vocab, dtype=torch.int64, device=scores.device)
            self._token_offsets = (ids * as_int64(_GOLDEN)).unsqueeze(0)
        tokens = torch.empty(batch, dtype=torch.int64, device=scores.device)
        for rows in self._chunks(batch, vocab):
            noise = _gumbel(_splitmix64_(row_keys[rows].unsqueeze(1) + self._token_offsets))
            tokens[rows] = noise.add_(scores[rows]).argmax(dim=-1)
        return tokens

    def __call__(self, logits: torch.Tensor, params: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, V] -> (token ids [B] int64, logprobs [B] float32)."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        if not params.any_sampled:  # all greedy: a point mass in "processed" mode, the raw logprob otherwise
            if self.logprobs_mode == "processed":
                return tokens, torch.zeros(tokens.shape, dtype=logits.dtype, device=logits.device)
            return tokens, self._logprobs(logits, tokens)
        sampled = params.temperatures > 0
        tempered = logits / torch.where(sampled, params.temperatures, 1.0).unsqueeze(1)
        processed = tempered
        if params.any_filtered:
            processed = torch.empty_like(tempered)
            for rows in self._chunks(*tempered.shape):
                processed[rows] = _top_k_top_p(tempered[rows], params.top_ks[rows], params.top_ps[rows])
        tokens = torch.where(sampled, self._noisy_argmax(processed, params.row_keys), tokens)
        if self.logprobs_mode == "raw":
            return tokens, self._logprobs(logits, tokens)
        if self.logprobs_mode == "tempered":  # greedy rows were divided by 1: their raw logprob
            return tokens, self._logprobs(tempered, tokens)
        return tokens, torch.where(sampled, self._logprobs(processed, tokens), 0.0)

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)


def _top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus of what is left."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1], device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_ks.unsqueeze(1), float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits = sorted_logits.masked_fill((mass_before > top_ps.unsqueeze(1)) & (ranks > 0), float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)


def _gumbel(bits: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise, float32, from the top 23 bits of each int64 of `bits` (uniform in (0, 1) exactly)."""
    uniform = bits.bitwise_right_shift_(41).bitwise_and_((1 << 23) - 1).to(torch.float32)
    return uniform.add_(0.5).mul_(2.0**-23).log_().neg_().log_().neg_()


def _splitmix64_(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors, in place (one temporary of x's size at a time); masks turn the
    arithmetic shifts into logical ones."""
    x.bitwise_xor_((x >> 30).bitwise_and_((1 << 34) - 1))
    x.mul_(as_int64(_MIX1))
    x.bitwise_xor_((x >> 27).bitwise_and_((1 << 37) - 1))
    x.mul_(as_int64(_MIX2))
    return x.bitwise_xor_((x >> 31).bitwise_and_((1 << 33) - 1))
