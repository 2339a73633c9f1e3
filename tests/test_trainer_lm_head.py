"""Logprobs and entropy computed chunk by chunk over the tokens (trainer/lm_head.py) are the full computation's:
values and gradients within 1e-6 in float64, whatever the chunk size and wherever a chunk boundary cuts a sequence;
the float32 head option keeps the head's matmul out of bf16."""

import pytest
import torch

from trainer.lm_head import full_token_stats, token_stats
from trainer.model import load_policy, run_policy


def random_head(tokens=37, hidden=8, vocab=50, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    inv_temps = (0.5 + torch.rand(tokens, generator=g, dtype=dtype))
    weights = torch.randn(2, tokens, generator=g, dtype=dtype)  # upstream gradients of logprobs and entropy
    return h, w, b, targets, inv_temps, weights


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 4096])
@pytest.mark.parametrize("tempered", [False, True])
def test_chunked_stats_and_gradients_equal_the_full_computation(chunk, tempered):
    h, w, b, targets, inv_temps, (g_lp, g_h) = random_head()
    scale = inv_temps if tempered else None
    logprobs, entropy = token_stats(h, w, b, targets, scale, chunk_tokens=chunk)
    full_logprobs, full_entropy = full_token_stats(h, w, b, targets, scale)
    torch.testing.assert_close(logprobs, full_logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(entropy, full_entropy, atol=1e-6, rtol=0)
    grads = torch.autograd.grad((logprobs * g_lp).sum() + (entropy * g_h).sum(), (h, w, b))
    full_grads = torch.autograd.grad((full_logprobs * g_lp).sum() + (full_entropy * g_h).sum(), (h, w, b))
    for mine, theirs in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_the_custom_backward_passes_gradcheck():
    h, w, b, targets, inv_temps, _ = random_head(tokens=9, hidden=4, vocab=11)
    assert torch.autograd.gradcheck(lambda h, w, b: token_stats(h, w, b, targets, inv_temps, chunk_tokens=4), (h, w, b))
    assert torch.autograd.gradcheck(lambda h, w: token_stats(h, w, None, targets, chunk_tokens=2)[0], (h, w))


def test_a_detached_entropy_contributes_no_gradient():
    h, w, b, targets, _, (g_lp, _) = random_head()
    logprobs, entropy = token_stats(h, w, b, targets, chunk_tokens=5)
    grads = torch.autograd.grad((logprobs * g_lp).sum() + entropy.detach().sum(), (h, w, b))
    full_logprobs, _ = full_token_stats(h, w, b, targets)
    for mine, theirs in zip(grads, torch.autograd.grad((full_logprobs * g_lp).sum(), (h, w, b)), strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def policy64(tiny_model_dir):
    return load_policy(tiny_model_dir, value_head=True, chunk_tokens=7).double()


def test_the_policy_in_float64_across_chunk_boundaries_that_split_sequences(policy64):
    """3 rows of 11 tokens = 30 predicting positions in chunks of 7: boundaries fall inside rows."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[2, 8:] = 0
    temps = torch.tensor([1.0, 0.7, 1.3])
    g_lp, g_h = torch.randn(2, 3, 10, generator=g, dtype=torch.float64)
    out = run_policy(policy64, ids, mask, temps, entropy_grad=True)
    params = [p for name, p in policy64.named_parameters() if not name.startswith("value_head.")]
    grads = torch.autograd.grad((out.logprobs * g_lp).sum() + (out.entropy * g_h).sum(), params)
    logits = policy64.lm(input_ids=ids, attention_mask=mask).logits[:, :-1] / temps.double()[:, None, None]
    log_p = torch.log_softmax(logits, -1)
    full_logprobs = log_p.gather(-1, ids[:, 1:, None])[..., 0]
    full_entropy = -(log_p.exp() * log_p).sum(-1)
    torch.testing.assert_close(out.logprobs, full_logprobs, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.entropy, full_entropy, atol=1e-6, rtol=0)
    full_grads = torch.autograd.grad((full_logprobs * g_lp).sum() + (full_entropy * g_h).sum(), params)
    for mine, theirs in zip(grads, full_grads, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_the_float32_head_keeps_the_matmul_out_of_bf16():
    """Under bf16 autocast the head's matmul rounds its logits to bf16 unless lm_head_fp32: with it, the logprobs
    are the float32 computation's; without, they are off by the bf16 rounding of the logits."""
    h, w, b, targets, _, _ = random_head(tokens=64, hidden=32, vocab=1000, dtype=torch.float32)
    exact, _ = full_token_stats(h.detach(), w.detach(), b.detach(), targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fp32, _ = token_stats(h, w, b, targets, chunk_tokens=16, fp32=True)
        bf16, _ = token_stats(h, w, b, targets, chunk_tokens=16, fp32=False)
    assert fp32.dtype == bf16.dtype == torch.float32
    assert (fp32 - exact).abs().max() < 1e-4
    assert (bf16 - exact).abs().max() > 1e-2
    fp32.sum().backward()  # the backward runs in the same dtypes
    assert h.grad.dtype == w.grad.dtype == torch.float32
