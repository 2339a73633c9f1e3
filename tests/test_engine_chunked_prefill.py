"""Chunked prefill: a prompt longer than the step's token budget is prefilled over several steps while the
running requests keep decoding, and gives the tokens (exactly) and logprobs (within 1e-5) of an unchunked
prefill; n samples fork in the step the prefill completes; chunks, prefix hits and preemption together."""

import pytest
import torch

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams

torch.set_num_threads(1)


def make_engine(model_dir, **overrides) -> LLMEngine:
    settings = {"block_size": 4, "max_model_len": 128, "max_num_seqs": 8, "max_n": 4, "enable_prefix_caching": False, **overrides}
    return LLMEngine(EngineConfig(model=str(model_dir), **settings))


def record_batches(engine: LLMEngine) -> list[dict[str, int]]:
    """Per batch the scheduler hands out from now on: the tokens each request computes in it."""
    batches = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        if batch is not None:
            batches.append({seq.request_id: n for seq in batch.seqs
                            if (n := batch.num_new_tokens.get(seq.seq_id)) is not None})
        return batch

    engine.scheduler.schedule = recording
    return batches


def run_script(engine: LLMEngine, long_prompt: list[int]) -> tuple[dict, list[list[str]]]:
    """A short request decoding, then a long one joining: each completion's (token, logprob) list, and the
    requests that produced a token in each step after the long one arrived."""
    outputs: dict[tuple[str, int], list[tuple[int, float]]] = {}
    produced: list[list[str]] = []

    def step() -> list[str]:
        done = []
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append((out.token_id, out.logprob))
            done.append(out.request_id)
        return done

    engine.add_request("short", [1, 5, 6, 7, 8], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    step()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        produced.append(step())
    return outputs, produced


def assert_same_outputs(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for key, tokens in got.items():
        assert [t for t, _ in tokens] == [t for t, _ in expected[key]], key
        torch.testing.assert_close(torch.tensor([lp for _, lp in tokens]),
                                   torch.tensor([lp for _, lp in expected[key]]), atol=1e-5, rtol=0)


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks_beside_decodes(tiny_model_dir):
    long_prompt = [1] + [3 + (i * 7) % 90 for i in range(49)]  # 50 tokens
    chunked = make_engine(tiny_model_dir, max_num_batched_tokens=16)
    batches = record_batches(chunked)
    chunked_out, produced = run_script(chunked, long_prompt)
    whole_out, whole_produced = run_script(make_engine(tiny_model_dir), long_prompt)

    assert_same_outputs(chunked_out, whole_out)
    # Budget 16: the short request's decode takes 1 token a step, the long prompt the 15 left, 15, 15, then 5.
    assert [b.get("long") for b in batches[1:5]] == [15, 15, 15, 5]
    assert all(b["short"] == 1 for b in batches[1:5])
    # The long request samples nothing until its last chunk; the short one produced a token every step.
    assert produced[:4] == [["short"], ["short"], ["short"], ["short", "long"]]
    assert whole_produced[0] == ["short", "long"]  # unchunked: the whole prompt beside one decode
    assert chunked.stats["prefill_tokens"] == 5 + 50
    assert chunked.block_manager.num_free_blocks == chunked.block_manager.num_blocks


def test_n_samples_fork_in_the_step_the_chunked_prefill_completes(tiny_model_dir):
    prompt = [1] + [4 + (i * 5) % 80 for i in range(39)]  # 40 tokens: 3 chunks of 16, 16, 8
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, n=4, seed=3, ignore_eos=True)
    chunked = make_engine(tiny_model_dir, max_num_batched_tokens=16)
    chunked.add_request("group", prompt, params)
    seqs = chunked.requests["group"]
    assert chunked.step() == [] and chunked.step() == []
    assert seqs[0].num_cached_tokens == 32 and all(not seq.block_table for seq in seqs[1:])
    assert sorted(out.index for out in chunked.step()) == [0, 1, 2, 3]
    assert all(seq.block_table[:10] == seqs[0].block_table[:10] for seq in seqs)
    outputs = {i: [] for i in range(4)}
    for seq in seqs:
        outputs[seq.index] = list(zip(seq.output_ids, seq.logprobs))
    while chunked.has_unfinished_requests():
        for out in chunked.step():
            outputs[out.index].append((out.token_id, out.logprob))
    [whole] = make_engine(tiny_model_dir).generate([prompt], params)
    expected = {c.index: list(zip(c.token_ids, c.logprobs)) for c in whole.completions}
    assert_same_outputs(outputs, expected)
    assert len({tuple(t for t, _ in tokens) for tokens in outputs.values()}) > 1
    assert chunked.block_manager.num_free_blocks == chunked.block_manager.num_blocks


def test_chunks_prefix_hits_and_preemption_together_match_a_roomy_unchunked_engine(tiny_model_dir):
    base = [1] + list(range(20, 47))  # 28 tokens shared by every prompt
    prompts = [base + [60 + i] * (1 + 3 * i) for i in range(6)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=16, seed=i, ignore_eos=True)
              for i in range(6)]
    tight = make_engine(tiny_model_dir, num_blocks=30, max_model_len=64, max_num_batched_tokens=12,
                        enable_prefix_caching=True)
    roomy = make_engine(tiny_model_dir)
    got = tight.generate(prompts, params)
    for out, expected in zip(got, roomy.generate(prompts, params)):
        assert out.completions[0].token_ids == expected.completions[0].token_ids
        torch.testing.assert_close(torch.tensor(out.completions[0].logprobs),
                                   torch.tensor(expected.completions[0].logprobs), atol=1e-5, rtol=0)
    assert tight.stats["preemptions"] > 0
    assert tight.stats["prefix_cache_hit_tokens"] > 0
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks


def test_the_budget_must_hold_one_decode_per_sequence_but_not_a_whole_prompt(tiny_model_dir):
    with pytest.raises(ValueError, match="max_num_batched_tokens: 4 cannot hold one decode token"):
        EngineConfig(model=str(tiny_model_dir), max_num_seqs=8, max_n=4, max_num_batched_tokens=4)
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=256, max_num_seqs=8, max_n=4, max_num_batched_tokens=8)
    assert config.max_num_batched_tokens < config.max_model_len
