"""One run's start in a process of its own, for tests/test_warmup_determinism.py: the SFT warm-up of deploy/experiment/warmup.py
from MODEL on a few additions, then its start metric measured twice.

The start metric is what a run's start evaluation computes: greedy completions of the held-out prompts, as the
rollout's GenerateMany asks its engine for them (all of a call's requests added together), scored by exact match.
With --late-acks, each lease's ack lands only once the training loop has taken the next batch's work, as on a
loaded machine whose ack thread runs late; without it, acks land as soon as their thread runs. Prints one JSON line.

    python tests/warmup_member.py MODEL OUT [--late-acks]
"""

import asyncio
import hashlib
import json
import pathlib
import sys
import threading

import torch

STEPS, BATCH = 8, 4
# A batch of 4 from 10 additions: batches straddle the ends of passes, where a sample just trained can be drawn again.
TRAIN = [(a, b) for a, b in ((12, 34), (56, 7), (81, 19), (40, 40), (3, 99), (27, 65), (90, 11), (15, 94), (62, 4),
                             (33, 33))]
HELD_OUT = [(a, b) for a, b in ((21, 43), (65, 8), (18, 91), (44, 4), (9, 39), (72, 56), (10, 90), (51, 49))]


def prompt_ids(tokenizer, a: int, b: int) -> list[int]:
    """The prompt as an experiment run tokenizes it (bos first: data.add_bos)."""
    return [tokenizer.bos_token_id, *tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)]


def sft_samples(tokenizer) -> list:
    from deploy.experiment.warmup import sft_sample

    return [sft_sample(f"{a}+{b}", prompt_ids(tokenizer, a, b),
                       [*tokenizer.encode(str(a + b), add_special_tokens=False), tokenizer.eos_token_id])
            for a, b in TRAIN]


def make_acks_late() -> None:
    """Each ack of lease dataset-N waits until the loop has taken batch N+1's work (the last one waits 0.5 s)."""
    from trainer.dataset import DatasetSource
    from trainer.leases import LeaseBook

    taken: dict[int, threading.Event] = {}
    work, ack = LeaseBook.work, DatasetSource.ack

    def taken_event(number: int) -> threading.Event:
        return taken.setdefault(number, threading.Event())

    def work_then_mark(self, batch):
        try:
            return work(self, batch)
        finally:
            taken_event(int(batch.lease_id.rsplit("-", 1)[1])).set()

    def late_ack(self, lease_id, trainer_version=None):
        taken_event(int(lease_id.rsplit("-", 1)[1]) + 1).wait(0.5)
        return ack(self, lease_id, trainer_version)

    LeaseBook.work, DatasetSource.ack = work_then_mark, late_ack


def start_metric(engine, tokenizer) -> tuple[float, list[list[int]]]:
    """(Exact-match accuracy, the completions' token ids) of greedy completions of HELD_OUT, in one GenerateMany."""
    from rollout.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=4, n=1)
    requests = [(f"eval/{i}", prompt_ids(tokenizer, a, b), params) for i, (a, b) in enumerate(HELD_OUT)]
    done = asyncio.run(engine.generate_all_many(requests))
    tokens = [list(map(int, completions[0].token_ids)) for completions in done]
    right = [tokenizer.decode(ids, skip_special_tokens=True).strip() == str(a + b)
             for ids, (a, b) in zip(tokens, HELD_OUT, strict=True)]
    return sum(right) / len(right), tokens


def main(model: pathlib.Path, out: pathlib.Path, late_acks: bool) -> dict:
    from transformers import AutoTokenizer

    from deploy.experiment.warmup import supervised_warmup
    from rollout.config import EngineConfig
    from rollout.engine.async_engine import AsyncEngine
    from rollout.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)  # as every caller of the warm-up does (deploy/runs/experiment_run.py)
    if late_acks:
        make_acks_late()
    tokenizer = AutoTokenizer.from_pretrained(model)
    out.mkdir(parents=True, exist_ok=True)  # the run's folder, where the warm-up writes its metrics
    supervised_warmup(model, out / "model-sft", sft_samples(tokenizer), STEPS, BATCH, 1e-3, seed=0)
    steps = [json.loads(line) for line in (out / "sft_metrics.jsonl").read_text().splitlines()]
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(out / "model-sft"), max_model_len=64)))
    try:
        first, again = start_metric(engine, tokenizer), start_metric(engine, tokenizer)
    finally:
        engine.shutdown()
    return {"sha256": hashlib.sha256((out / "model-sft" / "model.safetensors").read_bytes()).hexdigest(),
            "trained": [int(step["samples"]) for step in steps], "start": first, "start_again": again}


if __name__ == "__main__":
    print(json.dumps(main(pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), "--late-acks" in sys.argv[3:])))
