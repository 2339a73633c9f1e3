"""The sampler alone: Gumbel-max draws follow softmax, top-k/top-p masks, seeds, logprob modes."""

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollout.engine.sampler import Sampler, SamplingTensors, row_key


def tensors(rows: int, temperature=1.0, top_p=1.0, top_k=0, vocab=8, seeds=None, positions=None) -> SamplingTensors:
    seeds = seeds if seeds is not None else list(range(rows))
    return SamplingTensors(
        temperatures=torch.full((rows,), temperature),
        top_ps=torch.full((rows,), top_p),
        top_ks=torch.full((rows,), top_k if top_k > 0 else vocab, dtype=torch.int64),
        row_keys=torch.tensor([row_key(s, 0, p) for s, p in zip(seeds, positions or [0] * rows)], dtype=torch.int64),
        any_sampled=temperature > 0,
        any_filtered=temperature > 0 and (top_p < 1 or 0 < top_k < vocab),
    )


def test_draws_follow_the_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 0.2, 1.5])
    rows = 20_000
    tokens, logprobs = Sampler()(logits.expand(rows, -1), tensors(rows))
    freq = torch.bincount(tokens, minlength=8).float() / rows
    expected = logits.softmax(-1)
    assert (freq - expected).abs().max() < 0.015  # ~5 standard errors at 20k draws
    torch.testing.assert_close(logprobs, logits.log_softmax(-1)[tokens])


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([3.0, 2.9, 1.0, 0.0, -1.0, -2.0, -3.0, -4.0])
    rows = 4000
    tokens, _ = Sampler()(logits.expand(rows, -1), tensors(rows, top_k=2))
    assert set(tokens.tolist()) == {0, 1}
    probs = logits.softmax(-1)  # p0 ~ 0.44, p1 ~ 0.40: top_p 0.5 keeps both, top_p 0.3 only token 0
    tokens, _ = Sampler()(logits.expand(rows, -1), tensors(rows, top_p=0.5))
    assert set(tokens.tolist()) == {0, 1} and probs[:2].sum() > 0.5
    tokens, _ = Sampler()(logits.expand(rows, -1), tensors(rows, top_p=0.3))
    assert set(tokens.tolist()) == {0}


def test_seed_and_position_determine_the_draw_and_greedy_ignores_them():
    logits = torch.randn(1, 50).expand(64, -1)
    seeds = [2**64 - 1 - i for i in range(64)]  # the top of the uint64 range works
    a, _ = Sampler()(logits, tensors(64, vocab=50, seeds=seeds))
    b, _ = Sampler()(logits, tensors(64, vocab=50, seeds=seeds))
    c, _ = Sampler()(logits, tensors(64, vocab=50, seeds=seeds, positions=[1] * 64))
    assert torch.equal(a, b) and not torch.equal(a, c) and len(set(a.tolist())) > 10
    greedy, _ = Sampler()(logits, tensors(64, temperature=0.0, vocab=50, seeds=seeds))
    assert set(greedy.tolist()) == {int(logits[0].argmax())}


def test_processed_logprobs_use_the_sampled_distribution():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5], [1.0, 0.5, 0.0, -0.5]])
    params = tensors(2, temperature=0.5, top_k=2, vocab=4)
    tokens, logprobs = Sampler("processed")(logits, params)
    processed = torch.tensor([2.0, 1.0, float("-inf"), float("-inf")]).log_softmax(-1)
    torch.testing.assert_close(logprobs, processed[tokens])
    _, greedy_logprobs = Sampler("processed")(logits, tensors(2, temperature=0.0, vocab=4))
    assert greedy_logprobs.tolist() == [0.0, 0.0]


def test_batched_row_keys_equal_row_key():
    from rollout.engine.sampler import completion_key, row_keys

    seeds, indices, positions = [0, 1, 2**64 - 1, 12345], [0, 3, 15, 7], [0, 9, 4095, 2**40]
    expected = [row_key(s, i, p) for s, i, p in zip(seeds, indices, positions)]
    assert row_keys([completion_key(s, i) for s, i in zip(seeds, indices)], positions) == expected


class DtypeRecorder(TorchDispatchMode):
    """Records (op, dtype, shape) of every tensor an op returns while it is active."""

    def __init__(self):
        super().__init__()
        self.outputs: list[tuple[str, torch.dtype, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), t.dtype, tuple(t.shape)))
        return out


def test_no_float64_and_no_batch_by_vocab_int64_temporaries():
    """At B = 256, V = 151,936 a [B, V] int64 or float64 temporary is 311 MB: the noise and the top-k/top-p sort
    take a few rows at a time (int64 at most Sampler.chunk_elements), and nothing is float64."""
    rows, vocab = 256, 32_768  # B * V = 8M elements, twice the default chunk
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    params = tensors(rows, top_p=0.9, top_k=50, vocab=vocab)
    sampler = Sampler("processed")
    with DtypeRecorder() as recorder:
        tokens, logprobs = sampler(logits, params)
    assert not [o for o in recorder.outputs if o[1] == torch.float64]
    big_int64 = [o for o in recorder.outputs if o[1] == torch.int64 and math.prod(o[2]) > sampler.chunk_elements]
    assert not big_int64, big_int64[:5]
    assert tokens.shape == logprobs.shape == (rows,) and logprobs.dtype == torch.float32


def test_the_rows_a_chunk_takes_do_not_change_any_draw():
    logits = torch.randn(37, 300, generator=torch.Generator().manual_seed(1))
    seeds = [7 * i + 3 for i in range(37)]
    for top_k, top_p in ((0, 1.0), (20, 0.8)):
        params = tensors(37, top_k=top_k, top_p=top_p, vocab=300, seeds=seeds)
        whole, whole_lp = Sampler("processed")(logits, params)
        for chunk in (1, 300, 5 * 300 + 7):
            part, part_lp = Sampler("processed", chunk_elements=chunk)(logits, params)
            assert torch.equal(part, whole) and torch.equal(part_lp, whole_lp)
        alone, _ = Sampler("processed")(logits[5:6], tensors(1, top_k=top_k, top_p=top_p, vocab=300, seeds=seeds[5:6]))
        assert alone.item() == whole[5].item()  # a row draws the same token whatever it is batched with
