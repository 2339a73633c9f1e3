"""Sequence packing: samples laid end to end in rows, each attending only to itself, and the way back.

A micro-batch of n samples padded to [n, T] wastes every padding column in every layer. Packed, the samples
fill rows of about `row_tokens` tokens ([R, L], R * L close to the sum of their lengths), their position ids
restart at 0 for each sample, and attention stays inside each sample: by the samples' cumulative lengths
(`cu_seqlens`, trainer/varlen.py: torch's flash varlen kernel on CUDA, one attention per sample elsewhere), or
through a block-diagonal causal mask (transformers builds it from the restarting position ids; it costs a row's
length squared). The model's per-token outputs come back
as [n, T - 1], column for column what the padded forward gives, so the objectives do not know the difference.

    padded  [a a a . .]      packed  [a a a b b c c c c d]   positions [0 1 2 0 1 0 1 2 3 0]
            [b b . . .]
            [c c c c .]      unpack: each sample's columns gathered back to its own row
            [d . . . .]
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class PackedRows:
    """Samples packed into rows, with what the model needs and the map back to one row per sample."""

    input_ids: torch.Tensor  # [R, L]
    position_ids: torch.Tensor  # [R, L], restarting at 0 for every sample (and for a row's padding tail)
    cu_seqlens: torch.Tensor  # [segments + 1] int32: where each sample (or padding tail) starts in the R * L tokens
    max_seqlen: int  # the longest segment
    index: torch.Tensor  # [n, T - 1] int64: each sample column's place in the flattened [R, L - 1] outputs
    valid: torch.Tensor  # [n, T - 1] bool: the columns a sample has (its length - 1)
    token_src: torch.Tensor | None = None  # each packed token's place in the flattened [n, T] inputs
    token_dst: torch.Tensor | None = None  # ... and in the flattened [R, L] packed rows

    def pack_tokens(self, per_input: torch.Tensor, fill: float) -> torch.Tensor:
        """[n, T, ...] values of the input tokens (e.g. routed experts) -> [R * L, ...], as the packed tokens lie
        flattened row by row; `fill` where no sample's token is (a row's padding tail)."""
        flat = per_input.reshape(-1, *per_input.shape[2:])
        out = flat.new_full((self.input_ids.numel(), *per_input.shape[2:]), fill)
        out[self.token_dst.to(out.device)] = flat[self.token_src.to(flat.device)]
        return out

    def unpack(self, per_token: torch.Tensor) -> torch.Tensor:
        """[R, L - 1] per-token outputs of the packed rows -> [n, T - 1] in the padded layout (0 where no column)."""
        gathered = per_token.reshape(-1)[self.index]
        return torch.where(self.valid, gathered, torch.zeros_like(gathered))

    def spread(self, per_sample: torch.Tensor, fill: float = 1.0) -> torch.Tensor:
        """[n] values (e.g. 1 / a sample's temperature) -> [R, L - 1], each sample's value at its columns."""
        rows, length = self.input_ids.shape
        out = torch.full((rows * (length - 1),), fill, dtype=per_sample.dtype, device=per_sample.device)
        out[self.index[self.valid]] = per_sample[:, None].expand_as(self.valid)[self.valid]
        return out.view(rows, length - 1)

    def attention_kwargs(self) -> dict:
        """The FlashAttention-style keyword arguments transformers passes down to every attention call."""
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_seqlen, "max_length_k": self.max_seqlen}


def assign_rows(lengths: Sequence[int], row_tokens: int | None) -> list[list[int]]:
    """Sample indices per row: longest first, each into the first row it fits (first-fit decreasing).

    Rows hold up to `row_tokens` tokens (None: one row for all); a sample longer than that gets a row alone."""
    capacity = sum(lengths) if row_tokens is None else row_tokens
    rows: list[list[int]] = []
    room: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, free in enumerate(room) if lengths[index] <= free), None)
        if row is None:
            rows.append([])
            room.append(max(capacity, lengths[index]))
            row = len(rows) - 1
        rows[row].append(index)
        room[row] -= lengths[index]
    return rows


def pack_rows(input_ids: torch.Tensor, lengths: Sequence[int], row_tokens: int | None = None,
              pad_id: int = 0) -> PackedRows:
    """Pack the first `lengths[i]` tokens of each row of `input_ids` [n, T] (right-padded) into rows."""
    n, width = input_ids.shape
    rows = assign_rows(lengths, row_tokens)
    length = max(max(sum(lengths[i] for i in row) for row in rows), 2)
    src, dst, slots, positions, columns, column_src = [], [], [], [], [], []
    starts = []
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            size = lengths[i]
            steps = torch.arange(size)
            src.append(i * width + steps)
            dst.append(r * length + offset + steps)
            slots.append(dst[-1])
            positions.append(steps)
            columns.append(r * (length - 1) + offset + steps[:-1])
            column_src.append(i * (width - 1) + steps[:-1])
            starts.append(r * length + offset)
            offset += size
        if offset < length:  # the row's padding tail: a segment of its own
            tail = torch.arange(length - offset)
            slots.append(r * length + offset + tail)
            positions.append(tail)
            starts.append(r * length + offset)
    src_t, dst_t = torch.cat(src), torch.cat(dst)
    device = input_ids.device
    packed = torch.full((len(rows) * length,), pad_id, dtype=input_ids.dtype, device=device)
    packed[dst_t.to(device)] = input_ids.reshape(-1)[src_t.to(device)]
    position_ids = torch.zeros(len(rows) * length, dtype=torch.int64)
    position_ids[torch.cat(slots)] = torch.cat(positions)  # every packed slot is in one segment
    index = torch.zeros(n * (width - 1), dtype=torch.int64)
    valid = torch.zeros(n * (width - 1), dtype=torch.bool)
    column_src_t = torch.cat(column_src)
    index[column_src_t] = torch.cat(columns)
    valid[column_src_t] = True
    bounds = torch.tensor([*starts, len(rows) * length], dtype=torch.int32)
    return PackedRows(
        input_ids=packed.view(len(rows), length),
        position_ids=position_ids.view(len(rows), length).to(device),
        cu_seqlens=bounds.to(device),
        max_seqlen=int((bounds[1:] - bounds[:-1]).max()),
        index=index.view(n, width - 1).to(device),
        valid=valid.view(n, width - 1).to(device),
        token_src=src_t,
        token_dst=dst_t,
    )


def pack_by_token_sum(lengths: Sequence[int], budget: int, max_units: int) -> list[list[int]]:
    """Micro-batches of the indices of `lengths` whose real tokens (the sum of their lengths, as packed rows hold
    them) stay within `budget`, each of at most `max_units` units: first-fit decreasing. A unit longer than the
    budget goes alone."""
    packs: list[list[int]] = []
    used: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fits = (m for m, pack in enumerate(packs) if len(pack) < max_units and used[m] + lengths[index] <= budget)
        m = next(fits, None)
        if m is None:
            packs.append([])
            used.append(0)
            m = len(packs) - 1
        packs[m].append(index)
        used[m] += lengths[index]
    return packs
