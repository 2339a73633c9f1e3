"""The native engine against transformers: greedy tokens equal, logprobs within 1e-4 (float32),
with requests joining at different steps, n samples sharing prompt blocks, and forced preemption."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.outputs import Completion
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.sequence import FinishReason
from rollout.model.tiny import write_tiny_model

torch.set_num_threads(1)

ARCHS = {
    "qwen2": {"arch": "qwen2"},
    "qwen3-tied": {"arch": "qwen3", "tie_word_embeddings": True},
    "llama-hd64": {"arch": "llama", "head_dim": 64, "rope_theta": 500000.0},
}


@pytest.fixture(scope="module", params=list(ARCHS))
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param) / "m", seed=11, **ARCHS[request.param])


def random_prompts(count: int, low: int, high: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=gen).tolist()
    return [torch.randint(3, 100, (n,), generator=gen).tolist() for n in lengths]


def reference_logprobs(hf_model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token_t | prefix) from one transformers forward pass over prompt + tokens."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def run_staggered(engine: LLMEngine, waves: list[list[tuple[str, list[int], SamplingParams]]], steps_between: int):
    """Add each wave of requests `steps_between` steps after the previous one; run all to the end."""
    completions: dict[tuple[str, int], Completion] = {}
    for wave in waves:
        for request_id, prompt, params in wave:
            engine.add_request(request_id, prompt, params)
        for _ in range(steps_between):
            for out in engine.step():
                completions.setdefault((out.request_id, out.index), Completion(out.index)).add(out)
    while engine.has_unfinished_requests():
        for out in engine.step():
            completions.setdefault((out.request_id, out.index), Completion(out.index)).add(out)
    return completions


def test_greedy_and_logprobs_match_transformers_with_joins_and_preemption(model_dir):
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    # 24 blocks of 4 tokens cannot hold 9 sequences of up to 60 tokens: preemption is forced.
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_blocks=24, max_model_len=96))
    prompts = random_prompts(9, 3, 36, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    waves = [[(f"r{i}", prompts[i], greedy) for i in range(start, start + 3)] for start in (0, 3, 6)]
    completions = run_staggered(engine, waves, steps_between=4)

    assert engine.stats["preemptions"] > 0
    for i, prompt in enumerate(prompts):
        done = completions[(f"r{i}", 0)]
        expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt) :]
        assert done.token_ids == expected.tolist(), f"request {i}"
        assert done.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        ref = reference_logprobs(hf_model, prompt, done.token_ids)
        torch.testing.assert_close(torch.tensor(done.logprobs), ref, atol=1e-4, rtol=0)
    assert engine.block_manager.num_free_blocks == 24


def test_n_samples_share_prompt_blocks_and_logprobs_match(tiny_model_dir):
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, max_model_len=128))
    prompt = random_prompts(1, 30, 31, seed=2)[0]  # 30 tokens: 7 full blocks + a partial one
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, n=4, seed=5, ignore_eos=True)
    engine.add_request("group", prompt, params)

    engine.step()  # prefill: one computation of the prompt, four first tokens
    tables = [seq.block_table for seq in engine.requests["group"]]
    assert all(table == tables[0] for table in tables)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks - 8
    engine.step()  # first decode: each sample copies the shared partial block (copy-on-write)
    tables = [seq.block_table for seq in engine.requests["group"]]
    assert all(table[:7] == tables[0][:7] for table in tables)
    assert len({table[7] for table in tables}) == 4

    completions = run_staggered(engine, [], steps_between=0)
    seqs_out = [completions[("group", i)] for i in range(4)]
    assert len({tuple(c.token_ids) for c in seqs_out}) == 4
    for c in seqs_out:
        assert len(c.token_ids) == 20 - 2  # the two steps above were not collected
    full = engine.generate([prompt], params)[0].completions  # same seed: the same samples
    for c in full:
        assert c.token_ids[2:] == seqs_out[c.index].token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), reference_logprobs(hf_model, prompt, c.token_ids),
                                   atol=1e-4, rtol=0)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_is_independent_of_batch_and_preemption(tiny_model_dir):
    prompts = random_prompts(6, 5, 30, seed=3)
    params = [SamplingParams(temperature=0.8, top_k=20, max_tokens=30, seed=100 + i, ignore_eos=True) for i in range(6)]
    roomy = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=128))
    alone = [roomy.generate([p], [sp])[0].completions[0].token_ids for p, sp in zip(prompts, params)]
    tight = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, num_blocks=32, max_model_len=128))
    together = [out.completions[0].token_ids for out in tight.generate(prompts, params)]
    assert tight.stats["preemptions"] > 0
    assert together == alone


def test_sampling_respects_top_k_and_processed_logprobs(tiny_model_dir):
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=128, logprobs_mode="processed"))
    prompt = random_prompts(1, 12, 13, seed=4)[0]
    params = SamplingParams(temperature=0.7, top_k=5, max_tokens=16, n=3, seed=9, ignore_eos=True)
    for c in engine.generate([prompt], params)[0].completions:
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        top5 = logits.topk(5, dim=-1)
        chosen = torch.tensor(c.token_ids)
        assert (top5.indices == chosen.unsqueeze(1)).any(dim=1).all()
        processed = torch.full_like(logits, float("-inf")).scatter(1, top5.indices, top5.values / 0.7)
        expected = torch.log_softmax(processed, dim=-1).gather(1, chosen.unsqueeze(1)).squeeze(1)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_stop_tokens_max_tokens_and_abort_keep_partial_output(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=128))
    prompt = [5, 6, 7, 8]
    free_run = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    tokens = free_run.completions[0].token_ids
    assert len(tokens) == 12 and free_run.completions[0].finish_reason is FinishReason.LENGTH

    stopped = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(tokens[4],)))
    done = stopped[0].completions[0]
    assert done.token_ids == tokens[: tokens.index(tokens[4]) + 1] and done.finish_reason is FinishReason.STOP

    engine.add_request("long", prompt, SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    produced = [out.token_id for _ in range(5) for out in engine.step()]
    aborted = engine.abort("long")
    assert [(o.finish_reason, o.token_id) for o in aborted] == [(FinishReason.ABORT, None)]
    assert produced == tokens[:5]
    assert engine.abort("long") == [] and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_string_ends_completion(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=128))
    prompt = [10, 11, 12]
    tokens = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0]
    text = engine.tokenizer.decode(tokens.completions[0].token_ids)
    stop = text[5:7]
    done = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, stop=(stop,), ignore_eos=True))
    completion = done[0].completions[0]
    assert completion.finish_reason is FinishReason.STOP
    assert engine.tokenizer.decode(completion.token_ids).endswith(stop)
    assert len(completion.token_ids) <= 7


def test_bfloat16_runs_close_to_transformers(tiny_model_dir):
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", max_model_len=128))
    prompt = random_prompts(1, 20, 21, seed=6)[0]
    done = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=16, seed=1, ignore_eos=True))
    completion = done[0].completions[0]
    assert engine.runner.model.model.embed_tokens.weight.dtype == torch.bfloat16
    ref = reference_logprobs(hf_model, prompt, completion.token_ids)
    torch.testing.assert_close(torch.tensor(completion.logprobs), ref, atol=5e-2, rtol=0)


@pytest.mark.gpu
def test_greedy_matches_transformers_on_cuda(tiny_model_dir):
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval().cuda()
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), device="cuda", dtype="float32", block_size=4,
                                    num_blocks=40, max_model_len=96))
    prompts = random_prompts(6, 3, 30, seed=7)
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt], device="cuda")
        expected = hf_model.generate(ids, max_new_tokens=24, do_sample=False)[0, len(prompt) :].tolist()
        assert out.completions[0].token_ids == expected
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + expected], device="cuda")).logits[0].float()
        ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(1, torch.tensor(expected, device="cuda")[:, None])
        torch.testing.assert_close(torch.tensor(out.completions[0].logprobs), ref.squeeze(1).cpu(), atol=1e-4, rtol=0)


def test_compute_logprobs_match_transformers_between_steps_and_in_chunks(model_dir):
    """Teacher scoring: logprobs of given tokens equal a transformers forward, while other requests
    run, with a block pool too small to score every response at once; every block comes back."""
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=4, num_blocks=40, max_model_len=128))
    engine.add_request("busy", [5, 6, 7, 8], SamplingParams(temperature=1.0, max_tokens=30, seed=1, ignore_eos=True))
    engine.step()
    prompt = random_prompts(1, 10, 11, seed=4)[0]
    responses = random_prompts(5, 20, 40, seed=5) + [[]]
    scored = engine.compute_logprobs(prompt, responses)
    while engine.has_unfinished_requests():
        engine.step()
    assert [len(s) for s in scored] == [len(r) for r in responses]
    for response, logprobs in zip(responses[:-1], scored[:-1]):
        expected = reference_logprobs(hf_model, prompt, response)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-4, rtol=0)
    assert engine.block_manager.num_free_blocks == 40


def test_compute_logprobs_refuses_bad_ids_and_lengths(tiny_model_dir):
    from rollout.engine.errors import InvalidRequest

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=32))
    with pytest.raises(InvalidRequest, match=r"^response_ids\[1\]: token id 5000"):
        engine.compute_logprobs([1, 5], [[3], [5000]])
    with pytest.raises(InvalidRequest, match=r"^response_ids\[0\]: prompt \+ response \(40 tokens\)"):
        engine.compute_logprobs([1, 5], [[3] * 38])
    with pytest.raises(InvalidRequest, match=r"^prompt_ids: must not be empty"):
        engine.compute_logprobs([], [[3]])


def test_a_float32_lm_head_in_a_bf16_engine_gives_float32_logits_and_follows_weight_updates(tiny_model_dir):
    """engine.lm_head_fp32: the head's matmul in float32 over bf16 hidden states, with the published head itself
    where it arrives in float32 (the float32 checkpoint, a float32 update: unrounded; issue 34 item 7; the old engine
    made it from the bf16-rounded weight), made again from the served weight after an update in bfloat16."""
    import torch
    from safetensors.torch import load_file

    from rollout.config import EngineConfig
    from rollout.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16", lm_head_fp32=True))
    model = engine.runner.model
    name = "model.embed_tokens.weight" if model.config.tie_word_embeddings else "lm_head.weight"
    published = load_file(tiny_model_dir / "model.safetensors")[name]
    assert published.dtype == torch.float32 and not torch.equal(published.bfloat16().float(), published)
    hidden = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    logits = model.logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ published.T)
    doubled = published * 2 + 1e-3  # float32: served rounded, the head unrounded
    engine.load_weights({name: doubled}, version=1)
    torch.testing.assert_close(model.logits(hidden), hidden.float() @ doubled.T)
    rounded = (published * 3).bfloat16()  # bfloat16: the head from the served weight
    engine.load_weights({name: rounded}, version=2)
    torch.testing.assert_close(model.logits(hidden), hidden.float() @ rounded.float().T)
    adopted = {key: value.clone() for key, value in load_file(tiny_model_dir / "model.safetensors").items()}
    engine.load_weights(adopted, version=3, adopt=True)
    adopted[name].zero_()  # the head is a copy: the caller may reuse its tensor
    torch.testing.assert_close(model.logits(hidden), hidden.float() @ published.T)
    plain = LLMEngine(EngineConfig(model=str(tiny_model_dir), dtype="bfloat16"))
    assert plain.runner.model.logits(hidden).dtype == torch.bfloat16
