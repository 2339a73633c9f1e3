"""The shared starting checkpoint: a seeded tiny Qwen2, SFT-warmed by relayrl's trainer to a modest accuracy.

Supervised steps on (prompt, answer) pairs run through `trainer.learner.Learner` with the `sft`
algorithm until greedy held-out accuracy first reaches `target_accuracy` (checked every
`eval_every` steps) or `max_seconds` pass. The result is an HF folder both sides start from.
"""

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from _vs_trl.arith import TaskSpec, greedy_accuracy, prompt_ids
from deploy.experiment.tasks import Task
from protos.sample import Sample
from rollout.model.tiny import char_tokenizer, write_tiny_model
from trainer.config import TrainerConfig
from trainer.config.algorithm import AlgorithmConfig
from trainer.config.optim import BatchConfig, OptimConfig
from trainer.learner import Learner
from trainer.parallel import init_distributed


@dataclass(frozen=True)
class WarmStartSpec:
    """The model shape and the supervised warm-up that makes the starting checkpoint."""

    task: TaskSpec
    # Seed of the random init, of the SFT batch order and of torch.
    seed: int = 0
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    # None = 4 * hidden_size.
    intermediate_size: int | None = None
    # Stop SFT at the first check whose held-out greedy accuracy reaches this.
    target_accuracy: float = 0.3
    batch_size: int = 64
    lr: float = 1e-3
    eval_every: int = 10
    # Give up on the target after this long and keep what was reached.
    max_seconds: float = 300.0
    max_new_tokens: int = 6


def _sft_sample(tokenizer, task: Task, index: int) -> Sample:
    response = [*tokenizer(task.answer, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return Sample(
        sample_id=f"sft-{index}",
        prompt_id=task.prompt_id,
        prompt_ids=np.asarray(prompt_ids(tokenizer, task.prompt), dtype=np.int32),
        response_ids=np.asarray(response, dtype=np.int32),
        loss_mask=np.ones(len(response), dtype=np.uint8),
        rollout_logprobs=np.zeros(len(response), dtype=np.float32),
        weight_versions=np.zeros(len(response), dtype=np.int64),
    )


def build_start_checkpoint(spec: WarmStartSpec, workdir: Path, log=print) -> tuple[Path, dict]:
    """Write `workdir/sft` (reused when its recorded spec matches) and return (folder, summary)."""
    out = workdir / "sft"
    record = out / "warmstart.json"
    if record.exists() and json.loads(record.read_text())["spec"] == asdict(spec):
        summary = json.loads(record.read_text())["summary"]
        log(f"warm start: reusing {out} (held-out {summary['accuracy']:.3f})")
        return out, summary

    base = write_tiny_model(
        workdir / "init",
        hidden_size=spec.hidden_size,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        seed=spec.seed,
    )
    tokenizer = char_tokenizer()
    train, held_out = spec.task.split()
    learner = Learner(
        TrainerConfig(
            model_path=str(base),
            algorithm=AlgorithmConfig(name="sft"),
            optim=OptimConfig(lr=spec.lr),
            batch=BatchConfig(global_batch_size=spec.batch_size, micro_batch_size=spec.batch_size),
            seed=spec.seed,
            device="cpu",
        ),
        init_distributed("cpu"),
    )
    model = learner.policy.lm
    rng = random.Random(spec.seed)
    start = time.monotonic()
    step, accuracy = 0, greedy_accuracy(model, tokenizer, held_out, spec.max_new_tokens)
    while accuracy < spec.target_accuracy and time.monotonic() - start < spec.max_seconds:
        for _ in range(spec.eval_every):
            tasks = rng.sample(train, spec.batch_size)
            samples = [_sft_sample(tokenizer, task, step * spec.batch_size + i) for i, task in enumerate(tasks)]
            (mini_batch,) = learner.prepare(samples)
            learner.train_step(mini_batch, step)
            step += 1
        accuracy = greedy_accuracy(model, tokenizer, held_out, spec.max_new_tokens)
        log(f"warm start: SFT step {step}, held-out greedy {accuracy:.3f} ({time.monotonic() - start:.0f} s)")

    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    summary = {"accuracy": accuracy, "steps": step, "seconds": round(time.monotonic() - start, 1)}
    record.write_text(json.dumps({"spec": asdict(spec), "summary": summary}, indent=1))
    return out, summary
