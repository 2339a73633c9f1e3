"""Routing replay (R3): the experts each position of a sequence was routed to, as the engine computed its KV.

A mixture-of-experts model reports, after each forward, the experts of every token it ran ([T, sparse layers, top_k],
CausalLM.routed_experts). The runner writes each sequence's rows at their positions (`record`); the routes then
travel with the KV they describe: a fork takes its sibling's, full blocks offered to the prefix cache keep theirs
(BlockManager.block_routes) and hand them to the sequences that reuse the blocks, a session keeps its context's
between turns and across weight updates (kv_on_update keep). A completion carries them when every position but its
last (sampled, never fed back) has routes; KV imported from elsewhere (a prefill worker) has none, and neither
has the completion then.
"""

import numpy as np
import torch


class RouteLog:
    """Routes [positions, layers, top_k] of one sequence; `known` leading positions are recorded."""

    def __init__(self, rows: np.ndarray, known: int = 0):
        self.rows = rows
        self.known = known

    @classmethod
    def written(cls, log: "RouteLog | None", start: int, rows: np.ndarray) -> "RouteLog":
        """`log` (a new one when None) with `rows` written at positions start, start + 1, ..."""
        if log is None:
            log = cls(np.zeros((0, *rows.shape[1:]), rows.dtype))
        log.write(start, rows)
        return log

    def write(self, start: int, rows: np.ndarray) -> None:
        end = start + len(rows)
        if end > len(self.rows):
            grown = np.zeros((max(end, 2 * len(self.rows)), *self.rows.shape[1:]), self.rows.dtype)
            grown[: len(self.rows)] = self.rows
            self.rows = grown
        self.rows[start:end] = rows
        if start <= self.known:
            self.known = max(self.known, end)

    def prefix(self, num_positions: int) -> np.ndarray | None:
        """A copy of the routes of positions [0, num_positions), or None when some of them are not recorded."""
        return self.rows[:num_positions].copy() if self.known >= num_positions else None

    def block(self, index: int, size: int) -> np.ndarray | None:
        """A copy of the routes of block `index` (positions [index * size, (index + 1) * size)); None when some of
        its positions (or of those before it) are not recorded."""
        end = (index + 1) * size
        return self.rows[end - size : end].copy() if self.known >= end else None

    def copy(self) -> "RouteLog":
        return RouteLog(self.rows[: self.known].copy(), self.known)


def host_routes(experts: torch.Tensor, num_experts: int) -> np.ndarray:
    """A forward's routes on the host, in the narrowest wire type (uint8 up to 256 experts, else uint16)."""
    dtype = torch.uint8 if num_experts <= 256 else torch.int16
    rows = experts.to(dtype).cpu().numpy()
    return rows if dtype == torch.uint8 else rows.view(np.uint16)


def record(seqs: list, starts: list[int], lengths: list[int], rows: np.ndarray) -> None:
    """Write the flat rows of a forward (sequence after sequence, lengths[i] each from position starts[i])."""
    offset = 0
    for seq, start, length in zip(seqs, starts, lengths):
        seq.routes = RouteLog.written(seq.routes, start, rows[offset : offset + length])
        offset += length
