"""The main job (`relayrl run`): a tiny model learns 2-digit addition on one CPU machine.

    build model + task -> SFT warm-up -> start buffer, reward, rollout as processes
    -> driver (generate, score, put) and trainer (pull, GRPO step, ack, publish) run asynchronously
    -> held-out accuracy over time, a summary table, a plot and metrics JSONL

Every process of the RL phase is supervised (deploy/supervisor.py): a service that dies or freezes is
started again on its own address (the buffer recovers its log), the trainer resumes from its latest
checkpoint, the driver starts afresh under a new producer id. The run ends at its time budget or step
count, never because something died; a process that keeps dying fails the run (exit 1, naming it).
"""

import asyncio
import logging
import pathlib
import sys

from pydantic import Field

from deploy.pipeline_config import RLConfig
from deploy.run_state import Summary
from deploy.supervisor import SuperviseConfig
from deploy.tiny_model import ModelConfig
from services.config import Strict, load_config

log = logging.getLogger("relayrl.quickstart")
DEFAULT_CONFIG = pathlib.Path(__file__).with_name("quickstart.yaml")


class TaskConfig(Strict):
    """The verifiable task, generated in code (deploy.tasks)."""

    digits: int = Field(2, ge=1, le=3, description="Digits per operand.")
    op: str = Field("+", description="+, - or *.")
    num_eval: int = Field(200, gt=0, description="Held-out prompts (never trained on).")


class SFTConfig(Strict):
    """The supervised warm-up that gives RL a policy with some signal."""

    steps: int = Field(450, ge=0, description="Optimizer steps (0 = no warm-up); 450 gives ~0.3 held-out accuracy.")
    batch_size: int = Field(64, gt=0)
    lr: float = Field(1e-3, gt=0)


class QuickstartConfig(Strict):
    seed: int = Field(0, description="Seeds the model, the task split, sampling and training.")
    run_dir: str = Field("runs/quickstart", description="Where everything of the run is written (replaced; "
                         "`relayrl run --resume RUN_DIR` goes on in it).")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    start_checkpoint: str | None = Field(None, description="Start RL from this HF folder (skips building + SFT).")
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    rollout: dict = Field(default_factory=dict, description="Extra --set overrides for the rollout service.")
    buffer: dict = Field(default_factory=dict, description="Extra --set overrides for the buffer service.")
    supervise: SuperviseConfig = Field(default_factory=SuperviseConfig, description="Restarts of what dies.")


# ---------------------------------------------------------------- data


def _sft_samples(tasks, tokenizer):
    from deploy.warmup import sft_sample

    return [sft_sample(task.prompt_id,
                       [tokenizer.bos_token_id, *tokenizer.encode(task.prompt, add_special_tokens=False)],
                       [*tokenizer.encode(task.answer, add_special_tokens=False), tokenizer.eos_token_id])
            for task in tasks]


def sft_warmup(config: QuickstartConfig, init_dir: pathlib.Path, out_dir: pathlib.Path, train_tasks) -> None:
    """Supervised warm-up (deploy/warmup.py) on the task list's answers."""
    from transformers import AutoTokenizer

    from deploy.warmup import supervised_warmup

    samples = _sft_samples(train_tasks, AutoTokenizer.from_pretrained(init_dir))
    supervised_warmup(init_dir, out_dir, samples, config.sft.steps, config.sft.batch_size, config.sft.lr, config.seed)


# ---------------------------------------------------------------- evaluation


async def evaluate(address: str, prompts: list[tuple[list[int], str]], max_tokens: int, per_call: int = 64,
                   retry_for_s: float = 300.0) -> float:
    """Held-out greedy exact match through the rollout service (the weights it serves right now).

    A rollout that restarts (or is frozen and then restarted) is waited for: each call is retried on
    UNAVAILABLE / DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED for up to `retry_for_s`.
    """
    from deploy.evaluation import greedy_completions
    from reward.match import extract_answer, normalize

    completions = await greedy_completions(address, [ids for ids, _ in prompts], max_tokens, per_call, retry_for_s)
    # The reward's own rule (reward.match.exact_match), which bench/vs_trl.py's TRL side also uses.
    correct = sum(normalize(extract_answer(completion.text)) == normalize(answer)
                  for completion, (_, answer) in zip(completions, prompts, strict=True))
    return correct / len(prompts)


# ---------------------------------------------------------------- the run


def run_quickstart(config: QuickstartConfig, console=None, supervisor=None, resume: bool = False) -> Summary:
    """The whole run. `supervisor` (a deploy.supervisor.Supervisor, default one from config.supervise)
    lets a caller watch the processes it starts and restarts. With `resume`, the run in config.run_dir goes on
    from where it stopped (deploy/run_state.py): a whole SFT output is kept, the RL phase resumes."""
    import torch
    from transformers import AutoTokenizer

    from deploy.pipeline import run_pipeline
    from deploy.pipeline_config import Pipeline
    from deploy.progress import Progress
    from deploy.run_state import start_run_dir, whole_model
    from deploy.supervisor import Supervisor
    from deploy.tasks import arithmetic_tasks, split_tasks, write_jsonl

    torch.set_num_threads(1)
    run_dir = pathlib.Path(config.run_dir).resolve()
    start_run_dir(run_dir, config.model_dump(), config.seed, resume)
    progress = Progress(run_dir, console)

    train_tasks, eval_tasks = split_tasks(arithmetic_tasks(config.task.digits, config.task.op),
                                          config.task.num_eval, config.seed)
    if config.start_checkpoint:
        policy_dir = pathlib.Path(config.start_checkpoint).resolve()
    elif resume and config.sft.steps and whole_model(run_dir / "model-sft"):
        policy_dir = run_dir / "model-sft"
        progress.note(f"resuming: {policy_dir} is whole, so the model is not built and SFT not run again")
    else:
        init_dir = config.model.write(run_dir / "model-init", config.seed)
        policy_dir = run_dir / "model-sft" if config.sft.steps else init_dir
        if config.sft.steps:
            with progress.phase(f"SFT warm-up: {config.sft.steps} steps of {config.sft.batch_size}"):
                sft_warmup(config, init_dir, policy_dir, train_tasks)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    eval_prompts = [([tokenizer.bos_token_id, *tokenizer.encode(t.prompt, add_special_tokens=False)], t.answer)
                    for t in eval_tasks]
    prompts_path = write_jsonl(train_tasks, run_dir / "prompts.jsonl")
    plan = Pipeline(
        run_dir=run_dir, policy_dir=policy_dir, prompts_path=prompts_path, seed=config.seed, rl=config.rl,
        supervise=config.supervise, buffer=config.buffer, rollout=config.rollout,
        evaluate=lambda at: asyncio.run(evaluate(at.rollout, eval_prompts, config.rl.max_tokens)),
    )
    supervisor = supervisor or Supervisor(config.supervise)
    try:
        result = run_pipeline(plan, progress, supervisor)
    finally:
        supervisor.stop()
        progress.close()
    summary = result.summary(config.seed, run_dir)
    progress.finish(summary)
    return summary


def main(config_path: str | None = None, overrides: list[str] | None = None, resume: bool = False) -> int:
    from services.config import ConfigError

    try:
        config = load_config(QuickstartConfig, config_path or DEFAULT_CONFIG, overrides or [])
    except ConfigError as exc:
        print(f"relayrl run: {exc}", file=sys.stderr)
        return 2
    from deploy.supervisor import RunFailed

    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = run_quickstart(config, resume=resume)
    except RunFailed as exc:
        print(f"relayrl run failed: {exc}", file=sys.stderr)
        return 1
    return 0 if summary.final_accuracy > summary.sft_accuracy else 1
