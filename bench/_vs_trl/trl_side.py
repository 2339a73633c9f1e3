"""The baseline half of bench/vs_trl.py: Hugging Face TRL's GRPOTrainer on the arithmetic task.

Run as its own process (its threads and memory stay out of the relayrl run):

    PYTHONPATH=bench python -m _vs_trl.trl_side --model SFT_FOLDER --out curve.json --budget-s 600

Held-out greedy accuracy is measured on a wall-clock schedule by a TrainerCallback between
optimizer steps; each point is also appended to OUT's `.points.jsonl` as it is measured. The
clock is wall time since `trainer.train()` began, evaluations included (see vs_trl.py).
"""

import argparse
import json
import os
import time
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass(frozen=True)
class TRLRunSpec:
    """One GRPOTrainer run; fields shared with the relayrl run come from vs_trl.py."""

    model: str
    out: str
    budget_s: float = 600.0
    eval_every_s: float = 30.0
    seed: int = 0
    prompts_per_step: int = 8
    completions_per_prompt: int = 8
    lr: float = 3e-4
    # Linear warm-up from 0 to lr over this many steps, then constant (relayrl's schedule).
    warmup_steps: int = 0
    max_new_tokens: int = 6
    temperature: float = 1.0
    # torch intra-op threads of this process.
    threads: int = 1
    digits: int = 2
    num_eval: int = 500
    split_seed: int = 0


def parse_args() -> TRLRunSpec:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in fields(TRLRunSpec):
        flag = "--" + field.name.replace("_", "-")
        if field.default is MISSING:
            parser.add_argument(flag, required=True)
        else:
            parser.add_argument(flag, default=field.default, type=type(field.default))
    return TRLRunSpec(**vars(parser.parse_args()))


def main() -> None:
    spec = parse_args()
    import torch

    torch.set_num_threads(spec.threads)
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from _vs_trl.arith import TaskSpec, completion_text, greedy_accuracy, is_correct

    train, held_out = TaskSpec(spec.digits, "+", spec.num_eval, spec.split_seed).split()
    tokenizer = AutoTokenizer.from_pretrained(spec.model)
    model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=torch.float32)
    # TRL tokenizes prompt text with the tokenizer's own special-token handling: "<bos>" becomes bos.
    dataset = Dataset.from_list([{"prompt": tokenizer.bos_token + t.prompt, "answer": t.answer} for t in train])

    def exact_match(completion_ids: list[list[int]], answer: list[str], **_) -> list[float]:
        return [float(is_correct(completion_text(tokenizer, ids), ref)) for ids, ref in zip(completion_ids, answer)]

    points_path = Path(spec.out).with_suffix(".points.jsonl")
    points_path.unlink(missing_ok=True)

    class WallClockEval(TrainerCallback):
        """Held-out greedy accuracy every `eval_every_s`; stops training at the budget.

        The clock is wall time since `train()` began, evaluations included (as on the relayrl side).
        """

        def __init__(self) -> None:
            self.curve: list[dict] = []
            self.eval_s = 0.0
            self.started = 0.0
            self.next_eval = 0.0
            self.reward_mean: float | None = None
            self.first_step_s: float | None = None

        def clock(self) -> float:
            return time.monotonic() - self.started

        def evaluate(self, model, step: int) -> None:
            elapsed = self.clock()
            accuracy = greedy_accuracy(model, tokenizer, held_out, spec.max_new_tokens)
            self.eval_s += self.clock() - elapsed
            point = {
                "elapsed_s": round(elapsed, 2),
                "accuracy": accuracy,
                "step": step,
                "completions": step * spec.prompts_per_step * spec.completions_per_prompt,
                "reward_mean": self.reward_mean,
            }
            self.curve.append(point)
            with open(points_path, "a") as points:
                points.write(json.dumps(point) + "\n")
            self.next_eval = elapsed + spec.eval_every_s

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.started = time.monotonic()
            self.evaluate(model, 0)
            # The start point is measured before the clock runs, as on the relayrl side.
            self.started, self.eval_s = time.monotonic(), 0.0

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.reward_mean = logs.get("reward", self.reward_mean)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if self.first_step_s is None:
                self.first_step_s = self.clock()
            if self.clock() >= spec.budget_s:
                self.evaluate(model, state.global_step)
                control.should_training_stop = True
            elif self.clock() >= self.next_eval:
                self.evaluate(model, state.global_step)

    config = GRPOConfig(
        output_dir=str(Path(spec.out).parent / "trl_output"),
        # What the issue calls a fair configuration on CPU: full precision, no recomputation.
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        learning_rate=spec.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=spec.warmup_steps,
        # The per-device batch counts completions: 8 prompts x 8 completions = 64 per step.
        per_device_train_batch_size=spec.prompts_per_step * spec.completions_per_prompt,
        num_generations=spec.completions_per_prompt,
        gradient_accumulation_steps=1,
        max_completion_length=spec.max_new_tokens,
        temperature=spec.temperature,
        max_steps=10**7,  # the callback stops training at the wall-clock budget
        seed=spec.seed,
        data_seed=spec.seed,
        report_to=[],
        save_strategy="no",
        logging_strategy="steps",
        logging_steps=10,  # the mean training reward recorded with each evaluation
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    clock = WallClockEval()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=exact_match,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    trainer.train()
    steps = clock.curve[-1]["step"]
    train_s = clock.curve[-1]["elapsed_s"]
    result = {
        "system": f"TRL {trl.__version__} GRPOTrainer",
        "spec": asdict(spec),
        "curve": clock.curve,
        "steps": steps,
        "completions": clock.curve[-1]["completions"],
        "train_s": train_s,
        "eval_s": round(clock.eval_s, 2),
        "first_step_s": round(clock.first_step_s, 2),
        "loss_type": config.loss_type,
        "scale_rewards": config.scale_rewards,
        "beta": config.beta,
    }
    Path(spec.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
