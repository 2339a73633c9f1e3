"""Rollout and trainer logprobs refer to the distribution the tokens were drawn from.

At temperature 0.7 the native engine samples from softmax(logits / 0.7); the logprobs it reports, and the
ones the trainer recomputes for the PPO ratio and the importance weights, must be of that distribution
(equal within 1e-5 in float32 for the same weights), not of the raw temperature-1 one.
"""

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from protos.sample import Sample
from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.outputs import Completion
from rollout.engine.sampling_params import SamplingParams, logprobs_temperature
from rollout.model.tiny import write_tiny_model
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.parallel import DistEnv

TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("temp") / "m", seed=5)


def generate(model_dir, temperature: float, mode: str = "tempered") -> tuple[list[int], list[Completion]]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", logprobs_mode=mode, block_size=4, num_blocks=64, max_model_len=64))
    prompt = [1, 17, 23, 42, 8]
    engine.add_request("r", prompt, SamplingParams(temperature=temperature, max_tokens=12, n=4, seed=3, ignore_eos=True))
    completions: dict[int, Completion] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            completions.setdefault(out.index, Completion(out.index)).add(out)
    return prompt, [completions[i] for i in sorted(completions)]


def tempered_reference(model_dir, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each sampled token, from one transformers forward pass."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


def test_engine_reports_logprobs_of_the_tempered_distribution(model_dir):
    prompt, completions = generate(model_dir, TEMPERATURE)
    for completion in completions:
        expected = tempered_reference(model_dir, prompt, completion.token_ids, TEMPERATURE)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-5, rtol=0)


def test_trainer_recomputes_the_distribution_the_rollout_sampled(model_dir):
    prompt, completions = generate(model_dir, TEMPERATURE)
    samples = [
        Sample(
            sample_id=f"s{c.index}", prompt_id="p", group_size=len(completions),
            prompt_ids=np.asarray(prompt, np.int32), response_ids=np.asarray(c.token_ids, np.int32),
            loss_mask=np.ones(len(c.token_ids), np.uint8), rollout_logprobs=np.asarray(c.logprobs, np.float32),
            weight_versions=np.asarray(c.weight_versions, np.int64), reward=float(c.index % 2),
            temperature=logprobs_temperature("tempered", TEMPERATURE),
        )
        for c in completions
    ]
    config = TrainerConfig.model_validate({
        "model_path": str(model_dir), "algorithm": {"name": "grpo", "off_policy": "tis"},
        "batch": {"global_batch_size": len(samples), "micro_batch_size": 2},
    })
    learner = Learner(config, DistEnv(rank=0, world_size=1, device=torch.device("cpu")))
    assert learner.proximal_in_step  # one step per batch: the step's own forward gives pi_prox ...
    metrics = learner.train_step(learner.prepare(samples)[0], 0)
    assert metrics["is_weight"] == pytest.approx(1.0, abs=1e-4) and metrics["ratio"] == pytest.approx(1.0, abs=1e-6)
    learner = Learner(config, DistEnv(rank=0, world_size=1, device=torch.device("cpu")))
    learner.proximal_in_step = False  # ... here a pass of its own in prepare, where its logprobs can be read
    (batch,) = learner.prepare(samples)
    mask = batch.loss_mask.bool()
    for row, c in enumerate(completions):  # of the distribution sampled from, not the raw one
        expected = tempered_reference(model_dir, prompt, c.token_ids, TEMPERATURE)
        torch.testing.assert_close(batch.old_logprobs[row][mask[row]], expected, atol=1e-5, rtol=0)
    # The trainer's proximal logprobs equal the rollout's: the importance weights are exactly 1.
    torch.testing.assert_close(batch.old_logprobs[mask], batch.rollout_logprobs[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch.is_weights[mask], torch.ones(int(mask.sum())), atol=1e-4, rtol=0)


def test_raw_mode_reports_temperature_one(model_dir):
    prompt, completions = generate(model_dir, TEMPERATURE, mode="raw")
    assert logprobs_temperature("raw", TEMPERATURE) == 1.0
    expected = tempered_reference(model_dir, prompt, completions[0].token_ids, 1.0)
    torch.testing.assert_close(torch.tensor(completions[0].logprobs), expected, atol=1e-5, rtol=0)
