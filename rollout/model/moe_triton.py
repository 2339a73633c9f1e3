"""The experts of a mixture-of-experts layer as two Triton grouped GEMMs (fused MoE), behind moe.Experts.

The routed rows (token t's k-th choice is row t * k + j) are sorted by expert and each expert's rows padded to a
multiple of BLOCK_M, so that every tile of BLOCK_M rows belongs to one expert (`pad_by_expert`, on the device, with
no host sync). The first kernel computes, per tile and per BLOCK_N columns of the expert's width I, the gate and the
up projections of the tile's token rows together (gathered from x by index, never copied) and writes
silu(gate) * up; the second multiplies that by the expert's down projection and the row's routing weight. Both
accumulate in float32. The token's k rows are then summed in expert order, as the torch path (and transformers'
Qwen3MoeExperts) adds them.

On CUDA the kernels are compiled; on CPU tensors they run in Triton's interpreter (TRITON_INTERPRET=1 from the
process's start), which is how `make test` checks them against the torch path (tests/triton_kernel_cases.py).
"""

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # routed rows per tile (tl.dot's smallest)


def pad_by_expert(experts: torch.Tensor, num_experts: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, ...]:
    """(rows, tile_experts, order) for routed `experts` [T, k]: `rows` [P] holds each padded slot's routed row
    (t * k + j, -1 for padding), expert by expert, each expert's run a multiple of block_m long; `tile_experts`
    [P / block_m] the expert of each tile (-1 past the last used one); `order` the routed rows in expert order.
    P = T * k + num_experts * (block_m - 1), rounded up to block_m: a bound that depends on shapes alone."""
    flat = experts.flatten()
    routed = flat.numel()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded  # each expert's first padded slot
    first_sorted = torch.cumsum(counts, 0) - counts  # each expert's first row in `order`
    sorted_experts = flat[order]
    slots = starts[sorted_experts] + torch.arange(routed, device=flat.device) - first_sorted[sorted_experts]
    total = triton.cdiv(routed + num_experts * (block_m - 1), block_m) * block_m
    rows = torch.full((total,), -1, dtype=torch.int64, device=flat.device)
    rows[slots] = order
    tile_starts = torch.arange(0, total, block_m, device=flat.device)
    tile_experts = torch.searchsorted(starts + padded, tile_starts, right=True)
    tile_experts = torch.where(tile_experts < num_experts, tile_experts, -1)
    return rows, tile_experts, order


@triton.jit
def _gate_up_silu(
    x_ptr, w_ptr, out_ptr, rows_ptr, tile_experts_ptr,
    hidden, inner, top_k,
    stride_xt, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    col_tile = tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= 0:
        slots = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        routed = tl.load(rows_ptr + slots)
        row_ok = routed >= 0
        tokens = tl.where(row_ok, routed // top_k, 0).to(tl.int64)
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inner
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        for start in range(0, hidden, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            x = tl.load(x_ptr + tokens[:, None] * stride_xt + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            w_gate = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            w_up = tl.load(w_base + (cols + inner)[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)
            if UPCAST:
                x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
            gate += tl.dot(x, w_gate, input_precision=PRECISION)
            up += tl.dot(x, w_up, input_precision=PRECISION)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + slots.to(tl.int64)[:, None] * stride_ot + cols[None, :],
                 act.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_weighted(
    h_ptr, w_ptr, out_ptr, rows_ptr, tile_experts_ptr, weights_ptr,
    hidden, inner,
    stride_ht, stride_we, stride_wn, stride_ot,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    col_tile = tl.program_id(1)
    expert = tl.load(tile_experts_ptr + tile)
    if expert >= 0:
        slots = (tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        routed = tl.load(rows_ptr + slots)
        row_ok = routed >= 0
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_base = w_ptr + expert.to(tl.int64) * stride_we
        for start in range(0, inner, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < inner
            h = tl.load(h_ptr + slots[:, None] * stride_ht + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_base + cols[None, :] * stride_wn + ks[:, None], mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)
            if UPCAST:
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(h, w, input_precision=PRECISION)
        # The expert's output in the model dtype, then weighted: the torch path's two roundings.
        weight = tl.load(weights_ptr + tl.where(row_ok, routed, 0), mask=row_ok, other=0.0)
        out = acc.to(out_ptr.dtype.element_ty).to(tl.float32) * weight.to(tl.float32)[:, None]
        tl.store(out_ptr + slots[:, None] * stride_ot + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])


def _block(size: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(size)))


def fused_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, weights: torch.Tensor,
                  experts: torch.Tensor) -> torch.Tensor:
    """sum over k of weights[t, k] * expert[experts[t, k]](x[t]) for x [T, hidden], with gate_up_proj [E, 2I, hidden]
    and down_proj [E, hidden, I] as moe.Experts holds them."""
    num_experts, double_inner, hidden = gate_up_proj.shape
    inner, top_k = double_inner // 2, experts.shape[1]
    x = x.contiguous()
    rows, tile_experts, order = pad_by_expert(experts, num_experts)
    slots = rows.numel()
    # float32 matmuls where the inputs are (exact ones: "ieee", not TF32) and in the interpreter, whose dot gets 16-bit
    # floats wrong (Triton 3.9, as attention_triton.py found); on CUDA 16-bit inputs multiply in their dtype.
    upcast = x.dtype == torch.float32 or not x.is_cuda
    precision = "ieee" if upcast else "tf32"
    act = torch.empty(slots, inner, dtype=x.dtype, device=x.device)
    block_n, block_k = _block(inner, 64), _block(hidden, 64)
    _gate_up_silu[(tile_experts.numel(), triton.cdiv(inner, block_n))](
        x, gate_up_proj, act, rows, tile_experts, hidden, inner, top_k,
        x.stride(0), gate_up_proj.stride(0), gate_up_proj.stride(1), act.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, UPCAST=upcast,
    )
    out = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    block_n, block_k = _block(hidden, 64), _block(inner, 64)
    _down_weighted[(tile_experts.numel(), triton.cdiv(hidden, block_n))](
        act, down_proj, out, rows, tile_experts, weights.to(x.dtype).contiguous().flatten(), hidden, inner,
        act.stride(0), down_proj.stride(0), down_proj.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision, UPCAST=upcast,
    )
    used = rows >= 0  # padded slots in expert order: the routed rows in `order`'s order
    return torch.zeros_like(x).index_add_(0, order // top_k, out[used])
