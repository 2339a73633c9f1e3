"""From a list of samples to padded tensors aligned to next-token positions.

A sample of prompt length P and response length R fills input_ids[i, :P+R] (right padding).
Per-token tensors have T-1 columns, one per predicted token: column c holds what concerns
input_ids[i, c+1], so response token j sits at column P-1+j. The model's logits at position
c predict that token, and its value head at position c is the value of that state.
"""

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from protos.sample import Sample
from trainer.packing import pack_by_token_sum


@dataclass
class TrainBatch:
    """Padded tensors for a set of samples; rows can be sliced and selected together.

    Per-token fields are [rows, tokens - 1]; per-sequence fields are [rows]. Fields filled by
    later stages (advantages, weights, recomputed logprobs) start as None.
    """

    input_ids: torch.Tensor  # [rows, tokens] int64
    attention_mask: torch.Tensor  # [rows, tokens] int64
    loss_mask: torch.Tensor  # trained-on response tokens, float32
    rollout_logprobs: torch.Tensor  # behaviour policy, float32
    versions: torch.Tensor  # weight version per token, int64 (-1 off the response)
    rewards: torch.Tensor  # [rows] float32
    group_index: torch.Tensor  # [rows] int64, groups numbered by first appearance
    temperatures: torch.Tensor  # [rows] float32, the sampling temperature rollout_logprobs were taken at
    ref_logprobs: torch.Tensor | None = None  # reference / teacher logprobs
    advantages: torch.Tensor | None = None  # per token
    old_logprobs: torch.Tensor | None = None  # the policy the PPO ratio is taken against
    is_weights: torch.Tensor | None = None  # off-policy importance weights per token
    rejected: torch.Tensor | None = None  # off-policy rejection: 1.0 where a trained token was masked out
    old_values: torch.Tensor | None = None  # PPO: critic values before the update
    returns: torch.Tensor | None = None  # PPO: GAE returns
    loss_weights: torch.Tensor | None = None  # per token, see losses.loss_weights
    token_weights: torch.Tensor | None = None  # per token, token-mean weights for metrics
    row_weights: torch.Tensor | None = None  # per row, 1 / rows (DPO pairs)
    # [rows, tokens, layers, top_k] int16: the experts the rollout routed each input token to (Sample.routed_experts);
    # -1 where it has none (padding, a sample's last token); None: no sample carries routes
    routed_experts: torch.Tensor | None = None
    # A vision-language policy's images (trainer/vision.py): per row its patches [rows, patches, patch dim] and grids
    # [rows, images, 3], zero-padded; None for text
    pixel_values: torch.Tensor | None = None
    image_grids: torch.Tensor | None = None

    @property
    def images(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(pixel_values, image_grids) of a vision-language policy's batch; None for text."""
        return None if self.image_grids is None else (self.pixel_values, self.image_grids)

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn: Callable[[str, torch.Tensor], torch.Tensor]) -> "TrainBatch":
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return TrainBatch(**{name: None if value is None else fn(name, value) for name, value in fields.items()})

    def select(self, rows: torch.Tensor | slice) -> "TrainBatch":
        """The batch restricted to `rows` (a slice or an index tensor), every field alike."""
        return self._map(lambda _, value: value[rows])

    def to(self, device: torch.device) -> "TrainBatch":
        return self._map(lambda _, value: value.to(device))

    def trimmed(self) -> "TrainBatch":
        """Drop padding columns at the end that no row uses (cheaper forward passes)."""
        length = max(int(self.attention_mask.sum(-1).max()), 2)

        def trim(name: str, value: torch.Tensor) -> torch.Tensor:
            if value.dim() == 1 or name in ("pixel_values", "image_grids"):
                return value
            return value[:, :length] if name in ("input_ids", "attention_mask", "routed_experts") else value[:, : length - 1]

        return self._map(trim)


def group_indices(group_ids: Sequence[str]) -> torch.Tensor:
    """Group ids -> contiguous indices numbered by first appearance."""
    numbering: dict[str, int] = {}
    return torch.tensor([numbering.setdefault(g, len(numbering)) for g in group_ids], dtype=torch.int64)


def collate(samples: Sequence[Sample], pad_id: int = 0, vision=None) -> TrainBatch:
    """Pad `samples` into a TrainBatch. Every sample needs a non-empty prompt (at least a bos token). `vision` (a
    vision-language policy's trainer.vision.VisionInputs) adds their images as row tensors."""
    for sample in samples:
        if sample.prompt_ids.size == 0:
            raise ValueError(f"sample {sample.sample_id}: prompt_ids is empty (the first response token needs a context)")
    carries_ref = any(s.ref_logprobs.size for s in samples)
    if carries_ref:
        for sample in samples:
            if sample.ref_logprobs.size != sample.response_ids.size:
                raise ValueError(f"sample {sample.sample_id}: ref_logprobs missing while other samples carry them")
    rows = len(samples)
    tokens = max(s.prompt_ids.size + s.response_ids.size for s in samples)
    input_ids = np.full((rows, tokens), pad_id, dtype=np.int64)
    attention_mask = np.zeros((rows, tokens), dtype=np.int64)
    loss_mask = np.zeros((rows, tokens - 1), dtype=np.float32)
    rollout_logprobs = np.zeros((rows, tokens - 1), dtype=np.float32)
    ref_logprobs = np.zeros((rows, tokens - 1), dtype=np.float32)
    versions = np.full((rows, tokens - 1), -1, dtype=np.int64)
    for i, sample in enumerate(samples):
        prompt_len, response_len = sample.prompt_ids.size, sample.response_ids.size
        input_ids[i, :prompt_len] = sample.prompt_ids
        input_ids[i, prompt_len : prompt_len + response_len] = sample.response_ids
        attention_mask[i, : prompt_len + response_len] = 1
        columns = slice(prompt_len - 1, prompt_len - 1 + response_len)
        loss_mask[i, columns] = sample.loss_mask
        rollout_logprobs[i, columns] = sample.rollout_logprobs
        versions[i, columns] = sample.weight_versions
        if sample.ref_logprobs.size:
            ref_logprobs[i, columns] = sample.ref_logprobs
    batch = TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        loss_mask=torch.from_numpy(loss_mask),
        rollout_logprobs=torch.from_numpy(rollout_logprobs),
        versions=torch.from_numpy(versions),
        rewards=torch.tensor([s.reward for s in samples], dtype=torch.float32),
        group_index=group_indices([s.group_id for s in samples]),
        temperatures=torch.tensor([s.temperature or 1.0 for s in samples], dtype=torch.float32),
        ref_logprobs=torch.from_numpy(ref_logprobs) if carries_ref else None,
        routed_experts=collate_routes(samples, tokens),
    )
    if vision is not None:
        batch.pixel_values, batch.image_grids = vision.batch_tensors([s.images for s in samples])
    return batch


def collate_routes(samples: Sequence[Sample], tokens: int) -> torch.Tensor | None:
    """[rows, tokens, layers, top_k] int16 of the samples' routed experts, -1 where a sample has none; None when no
    sample carries routes. Samples whose routes differ in shape (another model) are an error."""
    shapes = {s.routed_experts.shape[1:] for s in samples if s.routed_experts.shape[0]}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"samples carry routed_experts of different shapes {sorted(shapes)} (layers, top_k)")
    routes = np.full((len(samples), tokens, *shapes.pop()), -1, dtype=np.int16)
    for i, sample in enumerate(samples):
        rows = sample.routed_experts
        routes[i, : rows.shape[0]] = rows
    return torch.from_numpy(routes)


def order_preference_pairs(samples: Sequence[Sample]) -> list[Sample]:
    """DPO: each group is one (chosen, rejected) pair; return them as [chosen, rejected, ...].

    The chosen sample is the one with the higher reward; a group that is not exactly two
    samples with different rewards is an error.
    """
    groups: dict[str, list[Sample]] = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
    ordered: list[Sample] = []
    for group_id, members in groups.items():
        if len(members) != 2 or members[0].reward == members[1].reward:
            rewards = [m.reward for m in members]
            raise ValueError(f"group {group_id}: DPO needs 2 samples with different rewards, got rewards {rewards}")
        ordered.extend(sorted(members, key=lambda s: -s.reward))
    return ordered


def pack_by_tokens(lengths: Sequence[int], budget: int, max_units: int) -> list[list[int]]:
    """Micro-batches of the indices of `lengths`, each within `budget` padded tokens (units x its longest) and
    `max_units` units: longest first, each filled greedily, so rows of like length share one. A unit longer
    than the budget goes alone."""
    packs: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        last = packs[-1] if packs else None
        if last is not None and len(last) < max_units and (len(last) + 1) * lengths[last[0]] <= budget:
            last.append(index)
        else:
            packs.append([index])
    return packs


def split_packs(packs: list[list[int]], lengths: Sequence[int], count: int, packed: bool = False) -> list[list[int]]:
    """`packs` split until there are `count` (every rank of a sharded step runs as many micro-batches): each
    time the one of most tokens is halved: padded tokens (units x the first, longest), or with `packed` the sum of
    the lengths. ValueError if there are fewer than `count` indices."""
    packs = [list(pack) for pack in packs]

    def tokens(pack: list[int]) -> int:
        return sum(lengths[i] for i in pack) if packed else len(pack) * lengths[pack[0]]

    while len(packs) < count:
        splittable = [m for m, pack in enumerate(packs) if len(pack) > 1]
        if not splittable:
            raise ValueError(f"{len(packs)} rows cannot make {count} micro-batches")
        m = max(splittable, key=lambda m: tokens(packs[m]))
        half = len(packs[m]) // 2
        packs[m:m + 1] = [packs[m][:half], packs[m][half:]]
    return packs


def plan_mini_batches(num_rows: int, mini_batches: int, world_size: int, unit: int = 1) -> tuple[list[range], int]:
    """Split `num_rows` rows (whole units of `unit` rows: DPO pairs) into at most `mini_batches` contiguous
    chunks as even as possible (no chunk empty), and the padded size of each: the largest chunk rounded up
    to a multiple of `world_size * unit`, so each rank takes the same whole number of units of every one."""
    units = num_rows // unit
    if units * unit != num_rows or units == 0:
        raise ValueError(f"a batch of {num_rows} rows is not a positive number of units of {unit}")
    steps = min(mini_batches, units)
    sizes = [units // steps + (m < units % steps) for m in range(steps)]
    starts = [sum(sizes[:m]) for m in range(steps)]
    chunks = [range(start * unit, (start + size) * unit) for start, size in zip(starts, sizes, strict=True)]
    step_units = -(-sizes[0] // world_size) * world_size
    return chunks, step_units * unit


def local_rows(steps: int, per_step: int, dp_size: int, dp_rank: int) -> torch.Tensor:
    """Indices of a rank's rows in a batch of `steps` mini-batches of `per_step` rows (pad_rows): its data-parallel
    group's contiguous share of every mini-batch."""
    per_rank = per_step // dp_size
    starts = [m * per_step + dp_rank * per_rank for m in range(steps)]
    return torch.cat([torch.arange(start, start + per_rank) for start in starts])


def pad_rows(batch: TrainBatch, chunks: list[range], per_step: int) -> TrainBatch:
    """The batch laid out as `len(chunks)` mini-batches of `per_step` rows: chunk m's rows, then padding.

    A padding row copies the shortest row (it never widens a micro-batch) with loss_mask zeroed
    (it runs right after collate, before any advantage), so it adds nothing to any loss or metric; advantage estimates skip it (real rows only). `row_weights` comes back 1 for a
    real row and 0 for padding (_set_weights turns it into the per-mini-batch row weights).
    """
    shortest = int(batch.attention_mask.sum(-1).argmin())
    index, real = [], []
    for chunk in chunks:
        index += [*chunk, *[shortest] * (per_step - len(chunk))]
        real += [1.0] * len(chunk) + [0.0] * (per_step - len(chunk))
    padded = batch.select(torch.tensor(index, dtype=torch.int64))
    padded.row_weights = torch.tensor(real, dtype=torch.float32)
    padding = padded.row_weights == 0
    padded.loss_mask[padding] = 0.0
    return padded


def micro_batch_rows(batch: TrainBatch, cfg, unit: int, agree: Callable[[int], int]) -> list[slice | torch.Tensor]:
    """This rank's micro-batches of `batch` (the trainer's `batch:` config `cfg`): micro_batch_size rows each, or
    packed by length under max_tokens_per_micro_batch, a unit of `unit` rows (DPO's pairs) kept whole; `agree(n)`
    is the largest n over the ranks (collective with a token budget: every rank runs as many)."""
    if cfg.max_tokens_per_micro_batch is None:
        size = cfg.micro_batch_size
        return [slice(start, start + size) for start in range(0, batch.num_rows, size)]
    per_unit = batch.attention_mask.sum(-1).view(-1, unit)
    max_units = max(1, cfg.micro_batch_size // unit)
    if cfg.packing:  # the budget counts real tokens: packed rows hold no padding
        lengths = per_unit.sum(-1).tolist()
        packs = pack_by_token_sum(lengths, cfg.max_tokens_per_micro_batch, max_units)
    else:
        lengths = per_unit.amax(-1).tolist()
        packs = pack_by_tokens(lengths, cfg.max_tokens_per_micro_batch // unit, max_units)
    packs = split_packs(packs, lengths, agree(len(packs)), packed=cfg.packing)
    return [torch.tensor([u * unit + j for u in pack for j in range(unit)], dtype=torch.int64) for pack in packs]
