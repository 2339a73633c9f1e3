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
import json
import logging
import pathlib
import shutil
import sys
import time
from dataclasses import dataclass, field

import yaml
from pydantic import Field

from deploy.supervisor import SuperviseConfig
from services.config import Strict, load_config

log = logging.getLogger("relayrl.quickstart")
DEFAULT_CONFIG = pathlib.Path(__file__).with_name("quickstart.yaml")


class ModelConfig(Strict):
    """The tiny decoder built in code (rollout.tiny.write_tiny_model)."""

    arch: str = Field("qwen2", description="qwen2, qwen3 or llama.")
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = Field(32, ge=32, description="Per-head width (vLLM's CPU attention needs >= 32).")


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


class RLConfig(Strict):
    """Asynchronous GRPO."""

    time_budget_s: float = Field(360.0, gt=0, description="Wall-clock budget of the RL phase.")
    max_steps: int = Field(100_000, gt=0, description="Stop after this many optimizer steps (if sooner).")
    group_size: int = Field(8, ge=2, description="Completions per prompt.")
    groups_per_batch: int = Field(8, ge=1, description="Prompts per optimizer step.")
    max_staleness: int = Field(1, ge=0, description="0 = synchronous on-policy; k = generation may run k versions "
                               "ahead (the PPO ratio against the sampling policy's logprobs corrects for it). 2 made "
                               "14% more completions/s here (1,609 vs 1,407 in 120 s runs, measured before GenerateMany).")
    temperature: float = Field(1.0, gt=0)
    max_tokens: int = Field(4, gt=0, description="Longest answer generated.")
    lr: float = Field(1e-4, gt=0, description="3e-4 collapsed the policy here (TRL's GRPOTrainer too); 1e-4 learns.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up (a fresh Adam's first steps are large).")
    eval_interval_s: float = Field(15.0, gt=0, description="Held-out greedy accuracy every this many seconds.")
    algorithm: dict = Field(default_factory=lambda: {"name": "grpo"},
                            description="trainer.config.AlgorithmConfig fields (variants: Dr. GRPO, DAPO, ...).")
    publish_overlap: bool = Field(True, description="Send new weights while the next step computes (trainer.config.PublishConfig.overlap).")
    driver_concurrency: int = Field(32, ge=1, description="Prompts the driver keeps in flight (more overlaps RPC latency; staleness stays bounded).")
    checkpoint_interval: int = Field(10, gt=0, description="Trainer checkpoint every this many steps: a restarted "
                                     "trainer resumes from it, and the batches trained since are held in the buffer "
                                     "(leased) until it is saved.")
    buffer_capacity_batches: int = Field(32, gt=0, description="Buffer capacity in batches (pending + leased, "
                                         "including those held until the next checkpoint).")
    metrics_sample_ids: bool = Field(False, description="List each step's sample ids in trainer_metrics.jsonl "
                                     "(audits what was trained, e.g. across restarts).")


class QuickstartConfig(Strict):
    seed: int = Field(0, description="Seeds the model, the task split, sampling and training.")
    run_dir: str = Field("runs/quickstart", description="Where everything of the run is written (replaced).")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    start_checkpoint: str | None = Field(None, description="Start RL from this HF folder (skips building + SFT).")
    sft: SFTConfig = Field(default_factory=SFTConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    rollout: dict = Field(default_factory=dict, description="Extra --set overrides for the rollout service.")
    buffer: dict = Field(default_factory=dict, description="Extra --set overrides for the buffer service.")
    supervise: SuperviseConfig = Field(default_factory=SuperviseConfig, description="Restarts of what dies.")


@dataclass
class Summary:
    seed: int
    sft_accuracy: float
    final_accuracy: float
    best_accuracy: float
    steps: int
    completions: int
    rl_seconds: float
    curve: list[dict] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    run_dir: str = ""


# ---------------------------------------------------------------- data


def _sft_samples(tasks, tokenizer):
    import numpy as np

    from protos.sample import Sample

    samples = []
    for task in tasks:
        prompt = [tokenizer.bos_token_id, *tokenizer.encode(task.prompt, add_special_tokens=False)]
        answer = [*tokenizer.encode(task.answer, add_special_tokens=False), tokenizer.eos_token_id]
        n = len(answer)
        samples.append(Sample(
            sample_id=f"sft/{task.prompt_id}", prompt_id=task.prompt_id,
            prompt_ids=np.asarray(prompt, np.int32), response_ids=np.asarray(answer, np.int32),
            loss_mask=np.ones(n, np.uint8), rollout_logprobs=np.zeros(n, np.float32),
            weight_versions=np.zeros(n, np.int64),
        ))
    return samples


def sft_warmup(config: QuickstartConfig, init_dir: pathlib.Path, out_dir: pathlib.Path, train_tasks) -> None:
    """Supervised warm-up through the same training loop RL uses, fed from the task list."""
    from transformers import AutoTokenizer

    from trainer.config import TrainerConfig
    from trainer.dataset import DatasetSource
    from trainer.loop import train
    from trainer.parallel import init_distributed

    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    cfg = TrainerConfig.model_validate({
        "model_path": str(init_dir),
        "algorithm": {"name": "sft"},
        "optim": {"lr": config.sft.lr, "max_grad_norm": 1.0},
        "batch": {"global_batch_size": config.sft.batch_size, "micro_batch_size": config.sft.batch_size},
        "max_steps": config.sft.steps,
        "seed": config.seed,
        "log_interval": 50,
        "checkpoint": {"export_dir": str(out_dir)},
        "metrics_path": str(out_dir.parent / "sft_metrics.jsonl"),
    })
    train(cfg, init_distributed("cpu"), DatasetSource(_sft_samples(train_tasks, tokenizer), seed=config.seed))


# ---------------------------------------------------------------- evaluation


_EVAL_RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")


async def evaluate(address: str, prompts: list[tuple[list[int], str]], max_tokens: int, per_call: int = 64,
                   retry_for_s: float = 300.0) -> float:
    """Held-out greedy exact match through the rollout service (the weights it serves right now).

    A rollout that restarts (or is frozen and then restarted) is waited for: each call is retried on
    UNAVAILABLE / DEADLINE_EXCEEDED / RESOURCE_EXHAUSTED for up to `retry_for_s`.
    """
    import grpc

    from protos import rollout_pb2, rollout_pb2_grpc
    from protos.codec import encode_array
    from reward.match import extract_answer, normalize
    from services.client import connect

    correct = 0
    async with connect(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        # `per_call` prompts per GenerateMany call, one call at a time: a round trip per chunk, not per prompt.
        for start in range(0, len(prompts), per_call):
            chunk = prompts[start:start + per_call]
            request = rollout_pb2.GenerateManyRequest(requests=[rollout_pb2.GenerateRequest(
                prompt_ids=encode_array(ids, "int32"),
                params=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1)) for ids, _ in chunk])
            give_up = time.monotonic() + retry_for_s
            while True:
                try:
                    reply = await stub.GenerateMany(request, timeout=30)
                    break
                except grpc.aio.AioRpcError as exc:
                    if exc.code().name not in _EVAL_RETRYABLE or time.monotonic() > give_up:
                        raise
                    await asyncio.sleep(0.5)
            # The reward's own rule (reward.match.exact_match), which bench/vs_trl.py's TRL side also uses.
            correct += sum(normalize(extract_answer(response.completions[0].text)) == normalize(answer)
                           for response, (_, answer) in zip(reply.responses, chunk, strict=True))
    return correct / len(prompts)


# ---------------------------------------------------------------- the run


def _write_yaml(path: pathlib.Path, data: dict) -> pathlib.Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _read_jsonl(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_quickstart(config: QuickstartConfig, console=None, supervisor=None) -> Summary:
    """The whole run. `supervisor` (a deploy.supervisor.Supervisor, default one from config.supervise)
    lets a caller watch the processes it starts and restarts."""
    import torch
    from transformers import AutoTokenizer

    from deploy.launcher import start_service
    from deploy.progress import Progress
    from deploy.provenance import write_provenance
    from deploy.service_registry import REGISTRY_FILE
    from deploy.status import run_targets
    from deploy.supervisor import Supervisor
    from deploy.tasks import arithmetic_tasks, split_tasks, write_jsonl
    from deploy.tensorboard import RunBoard
    from rollout.tiny import write_tiny_model

    torch.set_num_threads(1)
    run_dir = pathlib.Path(config.run_dir).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    (run_dir / "logs").mkdir(parents=True)
    _write_yaml(run_dir / "config.yaml", config.model_dump())
    write_provenance(run_dir, config.seed)
    progress = Progress(run_dir, console)

    train_tasks, eval_tasks = split_tasks(arithmetic_tasks(config.task.digits, config.task.op),
                                          config.task.num_eval, config.seed)
    if config.start_checkpoint:
        policy_dir = pathlib.Path(config.start_checkpoint).resolve()
    else:
        init_dir = write_tiny_model(run_dir / "model-init", seed=config.seed, arch=config.model.arch,
                                    hidden_size=config.model.hidden_size, num_layers=config.model.num_layers,
                                    num_heads=config.model.num_heads, num_kv_heads=config.model.num_kv_heads,
                                    head_dim=config.model.head_dim)
        policy_dir = run_dir / "model-sft" if config.sft.steps else init_dir
        if config.sft.steps:
            with progress.phase(f"SFT warm-up: {config.sft.steps} steps of {config.sft.batch_size}"):
                sft_warmup(config, init_dir, policy_dir, train_tasks)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    eval_prompts = [([tokenizer.bos_token_id, *tokenizer.encode(t.prompt, add_special_tokens=False)], t.answer)
                    for t in eval_tasks]
    prompts_path = write_jsonl(train_tasks, run_dir / "prompts.jsonl")
    rl = config.rl
    batch_size = rl.group_size * rl.groups_per_batch

    supervisor = supervisor or Supervisor(config.supervise)
    registry = run_dir / REGISTRY_FILE  # where `relayrl status RUN_DIR` finds the services
    board = RunBoard(run_dir, "driver", lambda: run_targets(run_dir))
    try:
        with progress.phase("starting buffer, reward and rollout services"):
            logs = run_dir / "logs"
            buffer = supervisor.add_service(start_service("buffer", {
                "data_dir": str(run_dir / "buffer"), "max_staleness": rl.max_staleness,
                "capacity": rl.buffer_capacity_batches * batch_size, **config.buffer}, log_dir=logs, registry=registry))
            reward = supervisor.add_service(start_service("reward", {}, log_dir=logs, registry=registry))
            rollout = supervisor.add_service(start_service("rollout", {
                "model": str(policy_dir), "engine.seed": config.seed, **config.rollout}, log_dir=logs, registry=registry))
        sft_accuracy = asyncio.run(evaluate(rollout.address, eval_prompts, rl.max_tokens))
        progress.note(f"held-out accuracy at the start of RL: {sft_accuracy:.3f}")

        driver_cfg = _write_yaml(run_dir / "driver.yaml", {
            "rollout": rollout.address, "reward": reward.address, "buffer": buffer.address,
            "prompts": str(prompts_path), "tokenizer": str(policy_dir), "group_size": rl.group_size,
            "groups_per_batch": rl.groups_per_batch, "max_staleness": rl.max_staleness,
            "temperature": rl.temperature, "max_tokens": rl.max_tokens, "concurrency": rl.driver_concurrency,
            "seed": config.seed, "stats_path": str(run_dir / "driver_stats.jsonl"),
        })
        trainer_cfg = _write_yaml(run_dir / "trainer.yaml", {
            "model_path": str(policy_dir),
            "algorithm": rl.algorithm,
            "optim": {"lr": rl.lr, "warmup_steps": rl.warmup_steps, "max_grad_norm": 1.0},
            "batch": {"global_batch_size": batch_size, "micro_batch_size": batch_size},
            "buffer": {"address": buffer.address},
            "max_steps": rl.max_steps,
            "max_staleness": rl.max_staleness,
            "publish": {"receivers": [rollout.address], "overlap": rl.publish_overlap},
            "seed": config.seed,
            "log_interval": 10,
            "metrics_path": str(run_dir / "trainer_metrics.jsonl"),
            "metrics_sample_ids": rl.metrics_sample_ids,
            "checkpoint": {"dir": str(run_dir / "checkpoints"), "interval": rl.checkpoint_interval},
            "heartbeat_path": str(run_dir / "trainer.heartbeat"),
        })
        started = time.monotonic()
        supervisor.add_process("trainer", ["-m", "trainer", "--config", str(trainer_cfg)], logs / "trainer.log",
                               exit_zero_is_done=True, heartbeat=run_dir / "trainer.heartbeat")
        supervisor.add_process("driver", ["-m", "rollout.driver", "--config", str(driver_cfg)], logs / "driver.log",
                               heartbeat=run_dir / "driver_stats.jsonl")
        progress.start_rl(rl.time_budget_s, sft_accuracy)
        curve = [progress.point(0.0, sft_accuracy)]
        board.eval(curve[-1])
        next_eval = started + rl.eval_interval_s
        while True:
            supervisor.check()  # RunFailed: something kept dying
            now = time.monotonic()
            if supervisor.done("trainer") or now - started >= rl.time_budget_s:
                break
            if now >= next_eval:
                next_eval = now + rl.eval_interval_s
                accuracy = asyncio.run(evaluate(rollout.address, eval_prompts, rl.max_tokens))
                point = progress.point(time.monotonic() - started, accuracy)
                curve.append(point)
                board.eval(point)
            progress.refresh(time.monotonic() - started)
            board.tick(time.monotonic() - started)
            time.sleep(0.5)
        rl_seconds = time.monotonic() - started
        for name in ("driver", "trainer"):
            supervisor.stop_member(name)
        final = asyncio.run(evaluate(rollout.address, eval_prompts, rl.max_tokens))
        curve.append(progress.point(rl_seconds, final))
        board.eval(curve[-1])
        supervisor.check()
    finally:
        supervisor.stop()
        board.close()
        progress.close()
    trainer_metrics = _read_jsonl(run_dir / "trainer_metrics.jsonl")
    driver_stats = _read_jsonl(run_dir / "driver_stats.jsonl")
    # Each driver process (a new producer id after a restart) counts from zero: sum their last records.
    completions = sum({d.get("producer_id"): d["samples"] for d in driver_stats}.values())
    summary = Summary(
        seed=config.seed, sft_accuracy=sft_accuracy, final_accuracy=final,
        best_accuracy=max(p["accuracy"] for p in curve), steps=trainer_metrics[-1]["step"] if trainer_metrics else 0,
        completions=completions, rl_seconds=rl_seconds, curve=curve, run_dir=str(run_dir),
        restarts=supervisor.restarts(),
    )
    progress.finish(summary)
    return summary


def main(config_path: str | None = None, overrides: list[str] | None = None) -> int:
    from services.config import ConfigError

    try:
        config = load_config(QuickstartConfig, config_path or DEFAULT_CONFIG, overrides or [])
    except ConfigError as exc:
        print(f"relayrl run: {exc}", file=sys.stderr)
        return 2
    from deploy.supervisor import RunFailed

    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = run_quickstart(config)
    except RunFailed as exc:
        print(f"relayrl run failed: {exc}", file=sys.stderr)
        return 1
    return 0 if summary.final_accuracy > summary.sft_accuracy else 1
