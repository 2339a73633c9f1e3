"""The engine's stage report (rollout/engine/step_stats.py): its stages tile the interval, its tokens are the
engine's, its FLOPs the shared model's (services/flops.py) held to FlopCounterMode, and the times a traced
request's spans are made from are in order."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from rollout.config import EngineConfig
from rollout.engine.async_engine import AsyncEngine
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.step_stats import STAGES

torch.set_num_threads(1)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24]]


def test_stage_report_tallies_tokens_and_tiles_the_interval(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    engine.step_stats.report()  # the interval starts now
    outputs = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=5, n=2, seed=1, ignore_eos=True))
    report = engine.step_stats.report()
    assert report["stage/interval_s"] == pytest.approx(sum(report[f"stage/{s}_s"] for s in STAGES), rel=1e-9)
    assert report["engine/prefill_tokens"] == sum(map(len, PROMPTS))  # each prompt once, its forks share it
    generated = sum(len(c.token_ids) for out in outputs for c in out.completions)
    # every sampled token but each completion's last is fed back by a decode step
    assert report["engine/decode_tokens"] == generated - 2 * len(PROMPTS)
    assert report["engine/scheduled"] >= len(PROMPTS) and report["engine/queue_wait_max_s"] >= 0
    assert 0 < report["engine/kv_used_mean"] <= report["engine/kv_used_peak"] <= 1
    assert report["stage/prefill_s"] > 0 and report["stage/decode_s"] > 0
    assert engine.step_stats.report()["engine/prefill_tokens"] == 0  # a report starts the next interval


def test_engine_flops_match_flop_counter(tiny_model_dir):
    """One prefill of a batch and one decode step: the count within 10% of torch's FlopCounterMode."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    params = SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS * 4):
        engine.add_request(f"r{i}", prompt * 6, params)
    for _ in range(2):  # the prefill step, then a decode step
        engine.step_stats.report()
        with FlopCounterMode(display=False) as counter:
            engine.step()
        counted, measured = engine.step_stats.report()["perf/flops"], counter.get_total_flops()
        assert counted == pytest.approx(measured, rel=0.10), (counted, measured)


async def test_completions_carry_their_times_in_order(tiny_model_dir):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64)))
    try:
        [done] = await engine.generate_all_many([("a", PROMPTS[0], SamplingParams(max_tokens=3, n=2))])
        for completion in done:
            arrival, scheduled, first_token, finished = completion.timing
            assert arrival <= scheduled <= first_token <= finished
        report = engine.step_stats.report()
        assert set(report) >= {f"stage/{s}_s" for s in STAGES} and report["stage/commands_s"] > 0
    finally:
        engine.shutdown()


def test_a_prefill_for_transfer_is_prefill(tiny_model_dir):
    """A PD prefill worker's prefills (rollout/engine/kv_handoff.py) count as prefill time and tokens."""
    from rollout.engine.kv_handoff import prefill_many_for_transfer

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64))
    engine.step_stats.report()
    prefill_many_for_transfer(engine, [("a", PROMPTS[0] * 4, SamplingParams(max_tokens=2))])
    report = engine.step_stats.report()
    assert report["engine/prefill_tokens"] == len(PROMPTS[0]) * 4 and report["engine/decode_tokens"] == 0
    assert report["stage/prefill_s"] > report["stage/commands_s"] and report["stage/decode_s"] == 0
