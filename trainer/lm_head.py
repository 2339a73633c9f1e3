"""The LM head's per-token outputs, computed a chunk of tokens at a time: never [tokens, vocabulary] at once.

For each next token: its logprob under softmax(head(hidden) / T) and the entropy of that distribution. The head's
matmul, the log-softmax and the entropy run over `chunk_tokens` rows of the flattened hidden states at a time, and
the backward recomputes each chunk's logits instead of keeping them (as fused linear-cross-entropy kernels do:
Liger's, Apple's cut-cross-entropy). The peak is a few [chunk, V] buffers instead of several [B, T, V] ones: at
V = 151,936 and 8k tokens the full float32 log-softmax alone is 4.6 GiB, a 1,024-token chunk 0.6 GiB.

`full_token_stats` is the computation written out whole, as the trainer did it before: the reference the tests
and bench/trainer_memory.py compare against.
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def compute_dtype(hidden: torch.Tensor, fp32: bool) -> torch.dtype:
    """The head matmul's dtype: float32 when asked (`model.lm_head_fp32`), else autocast's when it is on (bf16
    on GPU), else the hidden states' own. The log-softmax is always in at least float32."""
    if fp32:
        return torch.promote_types(hidden.dtype, torch.float32)
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return hidden.dtype


def token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_temperatures: torch.Tensor | None = None,
    *,
    chunk_tokens: int = 1024,
    fp32: bool = False,
    entropy: bool = True,
    group: dist.ProcessGroup | None = None,
    vocab_start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logprobs, entropy or None), each shaped like `targets`, of the next tokens `targets` given `hidden`.

    hidden [..., H] (the positions that predict), weight [V, H] and bias [V] (the head), targets [...] int64,
    inv_temperatures [...] (1 / the sampling temperature of each position; None = 1). Both outputs are float32
    (float64 for float64 inputs) and carry gradients to hidden, weight and bias; detach the entropy if its
    gradient is not wanted (its backward terms are then skipped).

    Vocabulary-parallel (tensor parallel): with `group`, weight and bias are this rank's rows of the head, from
    vocabulary id `vocab_start` on, and `hidden` is the same on every rank of the group; the softmax's max and sum,
    the target's logit and the entropy are summed over the group (Megatron's vocab-parallel cross-entropy), so
    each rank returns the whole-vocabulary numbers and the hidden states' whole gradient.
    """
    shape = targets.shape
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_scale = inv_temperatures.reshape(-1) if inv_temperatures is not None else None
    dtype = compute_dtype(hidden, fp32)
    logprobs, entropies = _ChunkedHead.apply(flat_hidden, weight, bias, targets.reshape(-1), flat_scale,
                                             chunk_tokens, dtype, entropy, group, vocab_start)
    return logprobs.view(shape), entropies.view(shape) if entropy else None


def head_token_stats(
    hidden: torch.Tensor, head: torch.nn.Module, input_ids: torch.Tensor, inv_temperatures: torch.Tensor | None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_stats of the next tokens of `input_ids` [B, T] from the decoder's last hidden states [B, T, H] through
    the LM head module: [B, T - 1] each. A tensor-parallel head (its weight a DTensor split by vocabulary row, its
    input split by sequence: trainer/parallel/tp.py) runs vocabulary-parallel on each rank's rows."""
    weight, bias = head.weight, head.bias
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(mesh, (Replicate(),)).to_local()
        rows = -(-weight.shape[0] // mesh.size())  # Shard(0) splits as torch.chunk does
        options |= {"group": mesh.get_group(), "vocab_start": min(mesh.get_local_rank() * rows, weight.shape[0])}
        weight, bias = weight.to_local(), bias.to_local() if bias is not None else None
    return token_stats(hidden[:, :-1], weight, bias, input_ids[:, 1:], inv_temperatures, **options)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None,
                  stat_dtype: torch.dtype) -> torch.Tensor:
    """[C, V] logits of one chunk (already in the compute dtype), divided by the temperature, in `stat_dtype`."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    logits = logits.to(stat_dtype)
    return logits.mul_(scale[:, None]) if scale is not None else logits


class _ChunkedHead(torch.autograd.Function):
    """Logprob of the target and entropy per row, chunk by chunk; the backward recomputes each chunk's logits.

    With z the tempered logits of a row, log p = z - logsumexp(z) and H = -sum p log p:
    d log p[target] / dz = onehot(target) - p and dH / dz = -p (log p + H); the logits' gradient is then scaled
    by 1 / T and pushed through the matmul into the hidden states, the weight and the bias.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, chunk_tokens, dtype, want_entropy, group, vocab_start):
        stat_dtype = torch.promote_types(dtype, torch.float32)
        rows = hidden.shape[0]
        local = _LocalTargets(targets, vocab_start, weight.shape[0])
        logprobs = hidden.new_empty(rows, dtype=stat_dtype)
        entropy = hidden.new_empty(rows if want_entropy else 0, dtype=stat_dtype)
        lse = hidden.new_empty(rows, dtype=stat_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            cast_weight = weight.to(dtype)
            cast_bias = bias.to(dtype) if bias is not None else None
            for start in range(0, rows, chunk_tokens):
                end = min(start + chunk_tokens, rows)
                z = _chunk_logits(hidden[start:end].to(dtype), cast_weight, cast_bias,
                                  scale[start:end] if scale is not None else None, stat_dtype)
                # log-softmax in two [C, V] buffers (torch.logsumexp would take two more): shift by the row max,
                # exponentiate once, normalise both in place.
                shift = _all_reduce(z.amax(-1, keepdim=True), group, dist.ReduceOp.MAX)
                z.sub_(shift)
                p = z.exp()
                total = _all_reduce(p.sum(-1, keepdim=True), group)
                lse[start:end] = (shift + total.log())[:, 0]
                log_p = z.sub_(total.log())
                logprobs[start:end] = _all_reduce(local.pick(log_p, start, end), group)
                if want_entropy:
                    entropy[start:end] = _all_reduce(-p.div_(total).mul_(log_p).sum(-1), group)
                del z, p, log_p  # before the next chunk's
        ctx.save_for_backward(hidden, weight, bias, scale, lse, entropy)
        ctx.chunk_tokens, ctx.dtype, ctx.group, ctx.local = chunk_tokens, dtype, group, local  # local: the targets
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, scale, lse, entropy = ctx.saved_tensors
        dtype, chunk_tokens = ctx.dtype, ctx.chunk_tokens
        stat_dtype = lse.dtype
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        group, local = ctx.group, ctx.local
        # Vocabulary-parallel ranks each hold a partial sum of the hidden states' gradient: summed in >= float32.
        hidden_grad_dtype = hidden.dtype if group is None else torch.promote_types(hidden.dtype, torch.float32)
        grad_hidden = torch.zeros_like(hidden, dtype=hidden_grad_dtype) if want_hidden else None
        accumulate = torch.promote_types(weight.dtype, torch.float32)  # the head's gradient summed in >= float32
        grad_weight = torch.zeros(weight.shape, dtype=accumulate, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=accumulate, device=bias.device) if want_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            cast_weight = weight.to(dtype)
            cast_bias = bias.to(dtype) if bias is not None else None
            for start in range(0, hidden.shape[0], chunk_tokens):
                end = min(start + chunk_tokens, hidden.shape[0])
                chunk_scale = scale[start:end] if scale is not None else None
                chunk_hidden = hidden[start:end].to(dtype)
                log_p = _chunk_logits(chunk_hidden, cast_weight, cast_bias, chunk_scale, stat_dtype)
                log_p.sub_(lse[start:end, None])
                p = log_p.exp()
                # grad_z = g_lp (onehot - p) - g_H p (log p + H), built in the two [C, V] buffers.
                coeff = log_p
                if grad_entropy is not None:
                    coeff.add_(entropy[start:end, None]).mul_(grad_entropy[start:end, None].to(stat_dtype))
                else:
                    coeff.zero_()
                if grad_logprobs is not None:
                    coeff.add_(grad_logprobs[start:end, None].to(stat_dtype))
                grad_z = p.mul_(coeff).neg_()
                if grad_logprobs is not None:
                    local.add_at(grad_z, grad_logprobs[start:end].to(stat_dtype), start, end)
                if chunk_scale is not None:
                    grad_z.mul_(chunk_scale[:, None].to(stat_dtype))
                grad_z = grad_z.to(dtype)
                if want_hidden:
                    grad_hidden[start:end] = (grad_z @ cast_weight).to(hidden_grad_dtype)
                if want_weight:
                    grad_weight.add_((grad_z.T @ chunk_hidden).to(accumulate))
                if want_bias:
                    grad_bias.add_(grad_z.sum(0).to(accumulate))
                del log_p, p, coeff, grad_z  # before the next chunk's: two [C, V] buffers live, not four
        if want_hidden and group is not None:
            grad_hidden = _all_reduce(grad_hidden, group).to(hidden.dtype)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if want_weight else None,
            grad_bias.to(bias.dtype) if want_bias else None,
            None, None, None, None, None, None, None,
        )


class _LocalTargets:
    """Where each target token falls in this rank's rows of the head (all of them without vocabulary parallelism)."""

    def __init__(self, targets: torch.Tensor, vocab_start: int, rows: int) -> None:
        local = targets - vocab_start
        self.inside = (local >= 0) & (local < rows)
        self.index = local.clamp(0, max(rows - 1, 0))[:, None]

    def pick(self, log_p: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The targets' entries of a chunk's [C, rows] log-probabilities; 0 where another rank holds the target."""
        picked = log_p.gather(1, self.index[start:end])[:, 0]
        return torch.where(self.inside[start:end], picked, torch.zeros_like(picked))

    def add_at(self, grad: torch.Tensor, values: torch.Tensor, start: int, end: int) -> None:
        """grad[row, target] += value where this rank holds the target."""
        grad.scatter_add_(1, self.index[start:end], (values * self.inside[start:end])[:, None])


def _all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None,
                op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def full_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_temperatures: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same numbers the plain way: the whole [..., V] logits, log-softmax, gather, entropy (the reference)."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if inv_temperatures is not None:
        logits = logits * inv_temperatures[..., None]
    log_p = torch.log_softmax(logits, -1)
    return log_p.gather(-1, targets[..., None])[..., 0], -(log_p.exp() * log_p).sum(-1)
