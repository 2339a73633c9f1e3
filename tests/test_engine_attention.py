"""Attention reads the paged cache one length class of sequences at a time (rollout/model/attention.py): classes give
the tokens and logprobs of one call padded to the longest context (the path before them), both equal
transformers', and a long sequence among short ones reads its blocks alone instead of padding every sequence
to its length."""

import torch
from transformers import AutoModelForCausalLM

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams

torch.set_num_threads(1)


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (n,), generator=gen).tolist() for n in lengths]


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    outputs = engine.generate(prompts, params)
    return [(c.token_ids, c.logprobs) for out in outputs for c in out.completions]


def reference_logprobs(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def test_length_classes_equal_one_padded_call_and_transformers(tiny_model_dir):
    """Blocks of 4 tokens, prompts of 3-70 tokens (classes of 1, 2, 3-4, ..., 17-32 blocks), greedy and sampled
    with n=3, mixed prefills and decodes, grouped-query attention (4 query / 2 kv heads)."""
    config = {"model": str(tiny_model_dir), "block_size": 4, "max_model_len": 128}
    classed = LLMEngine(EngineConfig(**config))
    whole = LLMEngine(EngineConfig(**config, attention_length_classes=False))
    prompts = prompts_of([3, 70, 9, 33, 17, 5, 52], seed=3)
    for params in (SamplingParams(temperature=0.0, max_tokens=30), SamplingParams(temperature=1.0, max_tokens=30, n=3, seed=7)):
        got, expected = generate(classed, prompts, params), generate(whole, prompts, params)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        for (_, logprobs), (_, reference) in zip(got, expected):
            torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(reference), atol=1e-5, rtol=0)
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    greedy = generate(classed, prompts, SamplingParams(temperature=0.0, max_tokens=30))
    for prompt, (tokens, logprobs) in zip(prompts, greedy):
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):]
        assert tokens == expected.tolist()[: len(tokens)]
        torch.testing.assert_close(torch.tensor(logprobs), reference_logprobs(hf_model, prompt, tokens), atol=1e-4, rtol=0)
    assert classed.block_manager.num_free_blocks == classed.block_manager.num_blocks


def test_session_turns_in_length_classes_equal_one_padded_call(tiny_model_dir):
    """A session's later turns prefill a few new tokens against a cached context of growing length, while three
    short requests decode beside it (two length classes in one step)."""
    config = {"model": str(tiny_model_dir), "block_size": 4, "max_model_len": 256}
    results = []
    for classes in (True, False):
        engine = LLMEngine(EngineConfig(**config, attention_length_classes=classes))
        engine.open_session("s", prompts_of([40], seed=5)[0])
        turns = []
        for turn in range(4):
            engine.add_session_request(f"t{turn}", "s", SamplingParams(temperature=0.0, max_tokens=12))
            for i, prompt in enumerate(prompts_of([3, 4, 5], seed=turn)):
                engine.add_request(f"short{turn}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=20))
            tokens = []
            while engine.has_unfinished_requests():
                tokens += [(out.token_id, out.logprob) for out in engine.step()]
            turns.append(tokens)
            engine.append_to_session("s", prompts_of([7 + turn], seed=10 + turn)[0])
        results.append(turns)
    for classed_turn, whole_turn in zip(*results):
        assert [t for t, _ in classed_turn] == [t for t, _ in whole_turn]
        torch.testing.assert_close(torch.tensor([lp for _, lp in classed_turn]), torch.tensor([lp for _, lp in whole_turn]),
                                   atol=1e-5, rtol=0)


def test_a_long_sequence_among_short_ones_reads_only_its_own_blocks(tiny_model_dir):
    """One 400-token prompt among 31 prompts of 6 tokens, blocks of 16: a decode step reads one block of each short
    sequence and the long one's 26 blocks alone (57 blocks), not 32 sequences padded to 26 blocks (832)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=16, max_model_len=512, max_num_seqs=32))
    prompts = prompts_of([400] + [6] * 31, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("long", prompts[0], params)
    long_tokens = [out.token_id for out in engine.step()]  # the long prompt's prefill alone
    for i, prompt in enumerate(prompts[1:]):
        engine.add_request(f"short{i}", prompt, params)
    groups = []
    prepare = engine.runner._prepare
    engine.runner._prepare = lambda *args: (result := prepare(*args), groups.append(result[2].groups))[0]
    while engine.has_unfinished_requests():
        long_tokens += [out.token_id for out in engine.step() if out.request_id == "long"]
    decode_steps = [g[0] for g in groups if g[0].max_query_len == 1 and g[0].num_seqs == 32]
    assert decode_steps
    for group in decode_steps:
        assert sorted((c.rows.numel(), c.num_blocks) for c in group.classes) == [(1, 26), (31, 1)]
        assert sum(c.block_ids.numel() for c in group.classes) == 57
    workspace = engine.runner.cache._workspace[0].shape[0]
    assert workspace == 31, workspace  # the widest read: the short class, not 32 x 26 blocks
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    expected = hf_model.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False)[0, 400:]
    assert long_tokens == expected.tolist()
