"""Deterministic runs (`deterministic: true`, services/determinism.py): two runs of one experiment file train the same
steps on the same numbers. The pieces (the settings it needs, a step's requests started together in the engine, a
merge that only counts decide, a hand-out order that arrival does not decide) and the whole: two short runs of the
quickstart project compared step by step."""

import asyncio
import json
import os
import pathlib
import subprocess
import sys

import pytest

from deploy.experiment.quickstart import write_project
from deploy.experiment.schema import load_experiment
from rollout.driver.call_merger import CallMerger
from services.buffer.entries import NewSample, PullSpec
from services.buffer.store import SampleStore
from services.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What a step trained on and how: equal to the last bit in two deterministic runs (timings and lease counters are not).
NUMBERS = ("reward_mean", "loss", "entropy", "ratio", "clip_fraction", "grad_norm", "tokens", "samples", "weight_version",
           "mismatch/abs_mean", "mismatch/abs_max", "mismatch/k3")
# A reward with partial credit (the share of the answer's digits in place): a model after a short warm-up earns some
# in most groups, so every step has advantages, a loss and a gradient to compare.
DIGITS_REWARD = '''
def digits(sample):
    answer, got = str(sample.metadata["answer"]), sample.response_text.strip()
    return sum(a == b for a, b in zip(answer, got)) / len(answer)
'''


def test_deterministic_needs_on_policy_training_and_one_rollout(tmp_path):
    experiment = write_project(tmp_path / "project")
    with pytest.raises(ConfigError, match="deterministic: needs max_staleness 0, not 1"):
        load_experiment(experiment, ["deterministic=true"])  # the quickstart runs ahead by one version
    with pytest.raises(ConfigError, match="deterministic: needs one rollout process, not 2 replicas"):
        load_experiment(experiment, ["deterministic=true", "training.max_staleness=0", "services.rollout.replicas=2"])
    assert load_experiment(experiment, ["deterministic=true", "training.max_staleness=0"]).deterministic


def test_a_deterministic_plan_tells_every_process(tmp_path):
    from deploy.rl.config import (
        Addresses,
        buffer_overrides,
        driver_config,
        rollout_overrides,
        trainer_config,
    )
    from deploy.runs.experiment_run import pipeline_plan
    from rollout.driver.driver import DriverConfig
    from services.buffer.config import BufferConfig
    from trainer.config import TrainerConfig

    config = load_experiment(write_project(tmp_path / "project"), ["deterministic=true", "training.max_staleness=0"])
    plan = pipeline_plan(config, tmp_path / "run", tmp_path / "model", tmp_path / "prompts.jsonl")
    addresses = Addresses("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3")
    assert DriverConfig(**driver_config(plan, addresses)).deterministic
    assert TrainerConfig(**trainer_config(plan, addresses)).deterministic
    # (the buffer's server.* overrides, such as its tracing, belong to the service around it, not to BufferConfig)
    assert BufferConfig(**{k: v for k, v in buffer_overrides(plan).items() if not k.startswith("server.")}).canonical_order
    assert rollout_overrides(plan)["engine.deterministic"] and rollout_overrides(plan)["engine.torch_threads"] == 1
    plain = pipeline_plan(load_experiment(write_project(tmp_path / "project")), tmp_path / "run", tmp_path / "model",
                          tmp_path / "prompts.jsonl")
    assert "deterministic" not in driver_config(plain, addresses) and "canonical_order" not in buffer_overrides(plain)


def test_generate_many_starts_its_requests_in_one_engine_step_in_order(tiny_model_dir):
    """Added by one command, a call's requests are in the same first step whatever the engine thread was doing: the
    batch (and so each logit's last bits) does not depend on when the thread woke between their adds."""
    from rollout.config import EngineConfig
    from rollout.engine.async_engine import AsyncEngine
    from rollout.engine.llm_engine import LLMEngine
    from rollout.engine.sampling_params import SamplingParams

    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=64)))
    steps: list[list[str]] = []
    schedule = engine.engine.scheduler.schedule

    def recorded():
        batch = schedule()
        if batch is not None:
            steps.append(list(dict.fromkeys(seq.request_id for seq in batch.seqs)))
        return batch

    engine.engine.scheduler.schedule = recorded
    params = SamplingParams(temperature=1.0, max_tokens=4, n=2, seed=7)
    requests = [(f"r{i}", [1, 10 + i, 20 + i], params) for i in range(6)]
    try:
        done = asyncio.run(engine.generate_all_many(requests))
    finally:
        engine.shutdown()
    assert steps[0] == [f"r{i}" for i in range(6)]
    assert [len(completions) for completions in done] == [2] * 6


def test_a_merger_without_a_window_sends_on_its_count_or_a_flush_only():
    async def run():
        sent: list[list[int]] = []

        async def send(items):
            sent.append(list(items))
            return items

        merger = CallMerger(send, window_s=None, max_items=3)
        first = asyncio.gather(merger.submit([1]), merger.submit([2]))
        await asyncio.sleep(0.05)
        waited = list(sent)  # no clock sends them
        merger.flush()
        await first
        await asyncio.gather(merger.submit([3]), merger.submit([4]), merger.submit([5]))  # full: sent at once
        return waited, sent

    waited, sent = asyncio.run(run())
    assert waited == [] and sent == [[1, 2], [3, 4, 5]]


def test_a_canonical_buffer_hands_out_the_same_batch_whatever_the_arrival_order():
    def handed_out(order: list[str], canonical: bool) -> list[str]:
        store = SampleStore(capacity=100, max_staleness=None, canonical_order=canonical)
        for name in order:
            samples = [NewSample(f"{name}/{i}", name, 3, 0) for i in reversed(range(3))]  # members out of order too
            store.check_groups(samples)
            store.add(samples, 0)
            store.publish(s.sample_id for s in samples)
        return [entry.sample_id for entry in store.lease(PullSpec(batch_size=6), now=0).entries]

    orders = [["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert {tuple(handed_out(order, True)) for order in orders} == {("a/0", "a/1", "a/2", "b/0", "b/1", "b/2")}
    assert len({tuple(handed_out(order, False)) for order in orders}) == 3  # by arrival


def _run(experiment: pathlib.Path, run_dir: pathlib.Path, *overrides: str) -> list[dict]:
    """One run of the experiment file (its own process: deterministic torch settings are process-wide); each step's
    trainer metrics."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "run", str(experiment), "--set", f"run_dir={run_dir}",
                           *(arg for override in overrides for arg in ("--set", override))],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_deterministic_runs_train_the_same_steps_on_the_same_numbers(tmp_path):
    """The quickstart project, on-policy, for a fixed number of steps (not a time budget): each step's rewards, losses,
    entropy, gradient norm and rollout-vs-trainer mismatch are equal in two runs, to the last bit.

    The rollout computes on 2 threads, where a batch's composition changes logprobs in their last bits (a request
    alone and beside 15 others differ by ~5e-7; on 1 thread they do not), and the held-out metric is asked for all the
    time (every 0.2 s, 64 prompts): without `deterministic` (before it existed too) greedy requests join a step's groups in the engine at
    moments that differ run to run, and so do the losses from step 1 on. A deterministic run evaluates at its start
    and end only and sends each step's groups as one request."""
    experiment = write_project(tmp_path / "project")
    (experiment.parent / "digits.py").write_text(DIGITS_REWARD)
    overrides = ("deterministic=true", "training.max_staleness=0", "training.max_steps=5", "training.groups_per_batch=4",
                 "training.time_budget_s=900", "sft.steps=60", "reward.function=digits:digits", "evaluation.every_s=0.2",
                 "data.num_eval=64", "checkpoint.interval=100", 'services.rollout.settings={"engine.torch_threads": 2}')
    first, second = (_run(experiment, tmp_path / name, *overrides) for name in ("first", "second"))
    assert [row["step"] for row in first] == [row["step"] for row in second] == [1, 2, 3, 4, 5]
    assert any(row["grad_norm"] > 0 for row in first) and len({row["reward_mean"] for row in first}) > 1
    for a, b in zip(first, second, strict=True):
        assert {name: a.get(name) for name in NUMBERS} == {name: b.get(name) for name in NUMBERS}, a["step"]
