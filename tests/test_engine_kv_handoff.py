"""A request prefilled on one engine and decoded on another (rollout/engine/kv_handoff.py, through the wire format of
rollout/pd/transfer.py) produces what one engine produces alone."""

import dataclasses

import pytest
import torch

from protos import rollout_pb2
from rollout.config import EngineConfig
from rollout.engine.errors import InvalidRequest, KVWeightVersionMismatch, QueueFull
from rollout.engine.kv_handoff import (
    add_prefilled_request,
    prefill_for_transfer,
    prefill_many_for_transfer,
    served_layout,
)
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.pd.transfer import pack, unpack

PROMPTS = [[3 + (i * 7 + j) % 90 for j in range(length)] for i, length in enumerate([5, 16, 33, 17, 48, 1])]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=1.0, max_tokens=10, n=3, seed=11, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=9, n=2, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=14, seed=5),
    SamplingParams(temperature=1.0, top_k=20, max_tokens=7, n=4, seed=99, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=1),  # finishes at its first token
]


def engine(model_dir, **kwargs) -> LLMEngine:
    kwargs.setdefault("max_model_len", 128)
    return LLMEngine(EngineConfig(model=str(model_dir), **kwargs))


def split_generate(prefill: LLMEngine, decode: LLMEngine, prompts, params_list, codec="none"):
    """Prefill each request on `prefill`, carry it over the wire format, decode it on `decode`; completions and bytes."""
    results: dict[str, dict[int, list]] = {}
    moved = 0
    for i, (prompt, params) in enumerate(zip(prompts, params_list)):
        request_id = f"r{i}"
        prefilled = prefill_for_transfer(prefill, request_id, prompt, params)
        request = rollout_pb2.GenerateRequest(request_id=request_id, params=rollout_pb2.SamplingParams(n=params.n))
        received = unpack(pack(request, prefilled, codec, chunk_bytes=4096), served_layout(decode))
        moved += received.payload_bytes
        results[request_id] = {k: [[], []] for k in range(params.n)}
        seeded = dataclasses.replace(params, seed=received.prefilled.seed)
        outputs = add_prefilled_request(decode, request_id, received.prefilled, seeded)
        while True:
            for out in outputs:
                if out.token_id is not None:
                    results[out.request_id][out.index][0].append(out.token_id)
                    results[out.request_id][out.index][1].append(out.logprob)
            if i < len(prompts) - 1 or not decode.has_unfinished_requests():
                break  # the next request joins while these decode: a mixed batch
            outputs = decode.step()
        if i < len(prompts) - 1:
            for out in decode.step():
                results[out.request_id][out.index][0].append(out.token_id)
                results[out.request_id][out.index][1].append(out.logprob)
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks
    return [results[f"r{i}"] for i in range(len(prompts))], moved


def test_split_equals_monolithic_greedy_tokens_and_logprobs(tiny_model_dir):
    mono = engine(tiny_model_dir).generate(PROMPTS, PARAMS)
    prefill, decode = engine(tiny_model_dir), engine(tiny_model_dir, seed=123)
    split, moved = split_generate(prefill, decode, PROMPTS, PARAMS)
    config = prefill.model_config
    assert moved == sum(2 * config.num_layers * len(p) * config.num_kv_heads * config.head_dim * 4 for p in PROMPTS)
    assert prefill.step_stats.num_prefill_tokens == sum(len(p) for p in PROMPTS)  # n samples prefilled once
    assert decode.step_stats.num_prefill_tokens == 0
    for output, got, params in zip(mono, split, PARAMS):
        assert len(output.completions) == params.n
        for completion in output.completions:
            tokens, logprobs = got[completion.index]
            assert tokens == completion.token_ids
            assert max(abs(a - b) for a, b in zip(logprobs, completion.logprobs)) < 1e-5


def test_int8_on_the_wire_moves_3_5x_fewer_bytes_and_agrees_on_greedy_tokens(sharp_model_dir):
    prompts = [[3 + (i * 5 + j * 3) % 90 for j in range(40 + 6 * i)] for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)] * len(prompts)
    mono = engine(sharp_model_dir).generate(prompts, params)
    _, plain = split_generate(engine(sharp_model_dir), engine(sharp_model_dir), prompts, params, "none")
    got, packed = split_generate(engine(sharp_model_dir), engine(sharp_model_dir), prompts, params, "int8")
    assert plain / packed >= 3.5
    agree = sum(a == b for out, g in zip(mono, got) for a, b in zip(out.completions[0].token_ids, g[0][0]))
    assert agree / sum(len(out.completions[0].token_ids) for out in mono) >= 0.99


def test_kv_of_other_weights_is_refused_and_the_engine_keeps_serving(tiny_model_dir):
    prefill, decode = engine(tiny_model_dir), engine(tiny_model_dir)
    params = SamplingParams(temperature=0, max_tokens=4, seed=1)
    prefilled = prefill_for_transfer(prefill, "a", PROMPTS[1], params)
    decode.load_weights({}, version=1)
    with pytest.raises(KVWeightVersionMismatch, match="version 0"):
        add_prefilled_request(decode, "a", prefilled, params)
    assert not decode.requests and decode.block_manager.num_free_blocks == decode.block_manager.num_blocks
    assert len(decode.generate([PROMPTS[0]], params)[0].completions[0].token_ids) == 4


def test_import_without_free_blocks_is_queue_full_and_takes_nothing(tiny_model_dir):
    prefill = engine(tiny_model_dir)
    decode = engine(tiny_model_dir, num_blocks=8, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=4, n=4, seed=1)
    prompt = [5] * 100  # 7 blocks + 4 slots for the first tokens > 8
    prefilled = prefill_for_transfer(prefill, "a", prompt, params)
    with pytest.raises(QueueFull):
        add_prefilled_request(decode, "a", prefilled, params)
    assert not decode.requests and decode.block_manager.num_free_blocks == 8
    assert torch.isfinite(prefilled.keys).all()


def test_a_batch_of_prefills_for_transfer_equals_one_at_a_time(tiny_model_dir):
    """The prefill worker's concurrent requests in one batch: the same first tokens, logprobs and KV as one by one,
    and a refused request (too long for the cache) refused alone."""
    alone_engine, batched_engine = engine(tiny_model_dir), engine(tiny_model_dir, num_blocks=24)
    too_long = SamplingParams(temperature=0, max_tokens=120)
    requests = [(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS))]
    requests.insert(2, ("huge", PROMPTS[4], too_long))
    alone = [prefill_for_transfer(alone_engine, rid, prompt, params) for rid, prompt, params in requests if rid != "huge"]
    batched = prefill_many_for_transfer(batched_engine, requests)
    assert isinstance(batched.pop(2), InvalidRequest)
    for one, many in zip(alone, batched, strict=True):
        assert many.first_token_ids == one.first_token_ids and many.seed == one.seed
        assert max(abs(a - b) for a, b in zip(many.first_logprobs, one.first_logprobs)) < 1e-5
        torch.testing.assert_close(many.keys, one.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(many.values, one.values, atol=1e-5, rtol=0)
    assert batched_engine.block_manager.num_free_blocks == batched_engine.block_manager.num_blocks


def test_concurrent_prefills_for_transfer_run_as_one_batch(tiny_model_dir):
    import asyncio
    import time

    from rollout.engine.async_engine import AsyncEngine

    async_engine = AsyncEngine(engine(tiny_model_dir))
    runs = []
    run = async_engine.engine.runner.run
    async_engine.engine.runner.run = lambda batch: runs.append(len(batch.seqs)) or run(batch)

    async def together():
        # held behind one command so that all six wait together, as calls do while the engine is busy
        gate = async_engine._submit(lambda: time.sleep(0.3))
        calls = [async_engine.prefill_for_transfer(f"r{i}", prompt, params)
                 for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS))]
        results = await asyncio.gather(*calls)
        gate.result()
        return results

    try:
        results = asyncio.run(together())
    finally:
        async_engine.shutdown()
    assert [len(r.first_token_ids) for r in results] == [p.n for p in PARAMS]
    assert runs == [sum(p.n for p in PARAMS)]  # one forward: every request's sequences
