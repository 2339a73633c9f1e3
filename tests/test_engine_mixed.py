"""Short prefills join the running decode in one step: same tokens and logprobs, and running requests
keep decoding while new ones arrive (instead of waiting behind one prefill step per arrival)."""

import torch

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams

torch.set_num_threads(1)


def run_arrivals(engine: LLMEngine, prompts: list[list[int]]) -> tuple[dict, int]:
    """One new request per step; returns the outputs and the step at which the first request finished."""
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=5)
    outputs: dict[tuple[str, int], list[tuple[int, float]]] = {}
    steps, first_done = 0, None
    pending = list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        if pending:
            i, prompt = pending.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        steps += 1
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append((out.token_id, out.logprob))
        if first_done is None and "r0" not in engine.requests:
            first_done = steps
    return outputs, first_done


def run_alone(engine: LLMEngine, prompts: list[list[int]]) -> dict:
    """Each request on its own (seeded sampling does not depend on the batch)."""
    outputs = {}
    for i, prompt in enumerate(prompts):
        [out] = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=5))
        for c in out.completions:
            outputs[(f"r{i}", c.index)] = list(zip(c.token_ids, c.logprobs))
    return outputs


def test_mixed_steps_give_the_same_completions_and_keep_decoding(tiny_model_dir):
    prompts = [[1, *range(10 + i, 16 + i)] for i in range(6)]
    mixing = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=64))
    separate = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=64))
    prepared = []
    prepare = mixing.runner._prepare
    mixing.runner._prepare = lambda *args: prepared.append(prepare(*args)) or prepared[-1]
    mixed_out, mixed_first_done = run_arrivals(mixing, prompts)
    # A mixed step attends in two groups: the decodes at one query each, the new prompt at its 7 tokens (before,
    # every decode row was padded to the prompt's 7 queries).
    mixed = [meta.groups for _, _, meta, _ in prepared if len(meta.groups) == 2]
    assert len(mixed) == 5
    for decodes, prompt in mixed:
        assert (decodes.max_query_len, decodes.classes[0].mask.shape[2], prompt.max_query_len) == (1, 1, 7)
        assert decodes.rows.stop == prompt.rows.start == decodes.num_seqs
    separate_out = run_alone(separate, prompts)

    assert mixed_out.keys() == separate_out.keys() and len(mixed_out) == 18
    for key, tokens in mixed_out.items():
        assert [t for t, _ in tokens] == [t for t, _ in separate_out[key]], key
        torch.testing.assert_close(torch.tensor([lp for _, lp in tokens]),
                                   torch.tensor([lp for _, lp in separate_out[key]]), atol=1e-5, rtol=0)
    assert mixed_first_done == 6  # its prefill, then one decode in each of the next 5 steps
    assert mixing.block_manager.num_free_blocks == mixing.block_manager.num_blocks
