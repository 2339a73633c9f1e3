"""The agentic job (`relayrl run --config examples/agentic/*.yaml`): a tiny model learns an environment by RL.

    build model -> SFT warm-up on transcripts played in code (rollout/envs/transcripts.py)
    -> start buffer and rollout (the rollout submits closed sessions to the buffer) as processes
    -> the episode runner (sessions, admission control) and the trainer (GRPO over the episodes of a task)
    -> held-out success rate (greedy episodes through sessions) over time, a summary table, metrics JSONL

The reward comes from the environment, so no reward service runs. A YAML file with `job: agentic` selects
this job; everything else about running it (supervision, restarts, the model: deploy/tiny_model.py, the warm-up:
deploy/warmup.py) is the quickstart's.
"""

import asyncio
import json
import logging
import pathlib
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import yaml
from pydantic import Field

from deploy.supervisor import SuperviseConfig
from deploy.tiny_model import ModelConfig
from services.config import Strict, load_config


class EnvJobConfig(Strict):
    """The environment (rollout/envs/base.py ENVIRONMENTS) and how long a policy turn may be."""

    name: str = Field(description="tool_use or guess_number.")
    config: dict = Field(default_factory=dict, description="The environment's Config fields.")
    max_tokens: int = Field(96, gt=0, description="Longest policy turn (a tool call is ~65 characters).")


class AgenticSFTConfig(Strict):
    """The warm-up on transcripts: partly trained (few steps, or an imperfect player) so RL has room."""

    steps: int = Field(150, ge=0, description="Optimizer steps (0 = none).")
    batch_size: int = Field(32, gt=0)
    lr: float = Field(1e-3, gt=0)
    transcripts: int = Field(4000, gt=0, description="Episodes played by the scripted player.")
    skill: float = Field(1.0, ge=0, le=1, description="Chance each player turn is the expert's (else a plausible "
                         "mistake: a wrong digit in the call, a guess anywhere the feedback left open).")


class AgenticRLConfig(Strict):
    """GRPO over episodes, asynchronous within max_staleness."""

    time_budget_s: float = Field(480.0, gt=0, description="Wall-clock budget of the RL phase.")
    max_steps: int = Field(100_000, gt=0, description="Stop after this many optimizer steps (if sooner).")
    group_size: int = Field(8, ge=2, description="Episodes per task (the GRPO group).")
    groups_per_batch: int = Field(8, ge=1, description="Tasks per optimizer step.")
    max_staleness: int = Field(1, ge=0, description="0 = synchronous; k = generation may run k versions ahead.")
    temperature: float = Field(1.0, gt=0)
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    algorithm: dict = Field(default_factory=lambda: {"name": "grpo"},
                            description="trainer.config.algorithm.AlgorithmConfig fields; off_policy defaults to bypass when "
                            "max_staleness > 0 (the PPO ratio against the rollout's logprobs, clipped: the stale "
                            "samples' importance ratio with a trust region), else none. tis/decoupled take the ratio "
                            "against the step's own start, which one optimizer step per batch never clips: on the "
                            "tool-use task at max_staleness 2 that collapsed to garbage within ~20 steps (README).")
    concurrency: int | None = Field(
        None, ge=1, description="Groups the runner keeps in flight; None = (max_staleness + 1) x groups_per_batch, "
        "so admission control alone bounds them.")
    eval_interval_s: float = Field(60.0, gt=0, description="Held-out success rate every this many seconds.")
    eval_concurrency: int = Field(32, gt=0, description="Greedy evaluation episodes in flight.")
    max_tokens_per_micro_batch: int | None = Field(
        2048, gt=0, description="The trainer's micro-batches by token budget (trainer batch.max_tokens_per_micro_batch): "
        "episodes of 1 to 3 turns padded to the longest cost ~1.8x; None = one micro-batch of the whole batch.")
    checkpoint_interval: int = Field(10, gt=0, description="Trainer checkpoint every this many steps.")
    rollout_replicas: int = Field(1, ge=1, description="Rollout processes; more than 1 runs them behind a router "
                                  "(deploy/replicas.py: sessions stay on their replica, new ones go to the least "
                                  "loaded) that `relayrl deploy scale rollout N --run RUN_DIR` scales.")
    buffer_capacity_batches: int = Field(32, gt=0, description="Buffer capacity in batches.")


class AgenticConfig(Strict):
    job: Literal["agentic"] = Field("agentic", description="Selects this job in `relayrl run`.")
    seed: int = Field(0, description="Seeds the model, the tasks, the transcripts, sampling and training.")
    run_dir: str = Field("runs/agentic", description="Where everything of the run is written (replaced).")
    model: ModelConfig = Field(default_factory=ModelConfig)
    env: EnvJobConfig
    start_checkpoint: str | None = Field(None, description="Start RL from this HF folder (skips building + SFT).")
    sft: AgenticSFTConfig = Field(default_factory=AgenticSFTConfig)
    rl: AgenticRLConfig = Field(default_factory=AgenticRLConfig)
    rollout: dict = Field(default_factory=dict, description="Extra --set overrides for the rollout service.")
    buffer: dict = Field(default_factory=dict, description="Extra --set overrides for the buffer service.")
    trainer: dict = Field(default_factory=dict, description="Extra trainer.config.TrainerConfig fields (e.g. "
                          "num_threads), over the ones this job sets.")
    supervise: SuperviseConfig = Field(default_factory=SuperviseConfig, description="Restarts of what dies.")


@dataclass
class AgenticSummary:
    seed: int
    env: str
    start_success: float  # held-out, greedy, after SFT
    final_success: float
    best_success: float
    steps: int
    episodes: int
    sft_seconds: float
    rl_seconds: float
    total_seconds: float
    curve: list[dict] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)
    run_dir: str = ""


def selects(config_path: str | None) -> bool:
    """Whether the YAML file at `config_path` asks for this job (`job: agentic`)."""
    path = pathlib.Path(config_path) if config_path else None
    if path is None or not path.is_file():
        return False
    data = yaml.safe_load(path.read_text())
    return isinstance(data, dict) and data.get("job") == "agentic"


def _write_yaml(path: pathlib.Path, data: dict) -> pathlib.Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _last_records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run_agentic(config: AgenticConfig, console=None, supervisor=None) -> AgenticSummary:
    """The whole run; `supervisor` (deploy.supervisor.Supervisor) lets a caller watch its processes."""
    import torch
    from rich.console import Console
    from transformers import AutoTokenizer

    from deploy.launcher import start_service
    from deploy.progress import Progress
    from deploy.provenance import write_provenance
    from deploy.replicas import RolloutReplicas
    from deploy.service_registry import REGISTRY_FILE
    from deploy.status import run_targets
    from deploy.supervisor import Supervisor
    from deploy.tensorboard import RunBoard
    from deploy.warmup import supervised_warmup
    from rollout.envs.runner import env_spec, evaluate
    from rollout.envs.transcripts import transcripts

    torch.set_num_threads(1)
    began = time.monotonic()
    console = console or Console()
    run_dir = pathlib.Path(config.run_dir).resolve()
    if run_dir.exists():
        shutil.rmtree(run_dir)
    logs = run_dir / "logs"
    logs.mkdir(parents=True)
    _write_yaml(run_dir / "config.yaml", config.model_dump())
    write_provenance(run_dir, config.seed)
    progress = Progress(run_dir, console)
    env_cls, env_config = env_spec(config.env.name, config.env.config)
    train_tasks, eval_tasks = env_cls.tasks(env_config, config.seed)

    sft_started = time.monotonic()
    if config.start_checkpoint:
        policy_dir = pathlib.Path(config.start_checkpoint).resolve()
    else:
        init_dir = config.model.write(run_dir / "model-init", config.seed)
        policy_dir = run_dir / "model-sft" if config.sft.steps else init_dir
        if config.sft.steps:
            with progress.phase(f"SFT warm-up: {config.sft.steps} steps of {config.sft.batch_size} "
                                f"{config.env.name} transcripts"):
                samples = transcripts(AutoTokenizer.from_pretrained(init_dir), config.env.name, config.env.config,
                                      train_tasks, config.sft.transcripts, config.sft.skill, config.seed)
                # the loss on the player's tokens (the transcripts' loss masks)
                supervised_warmup(init_dir, policy_dir, samples, config.sft.steps, config.sft.batch_size,
                                  config.sft.lr, config.seed, log_interval=25)
    sft_seconds = time.monotonic() - sft_started
    rl = config.rl
    batch_size = rl.group_size * rl.groups_per_batch
    off_policy = "bypass" if rl.max_staleness > 0 else "none"
    concurrency = rl.concurrency or (rl.max_staleness + 1) * rl.groups_per_batch

    def success(address: str) -> dict:
        return asyncio.run(evaluate(address, config.env.name, config.env.config, eval_tasks, config.env.max_tokens,
                                    rl.eval_concurrency))

    supervisor = supervisor or Supervisor(config.supervise)
    registry = run_dir / REGISTRY_FILE  # where `relayrl status RUN_DIR` finds the services
    board = RunBoard(run_dir, "runner", lambda: run_targets(run_dir))
    replicas = None  # RolloutReplicas when the rollout runs as replicas behind a router
    try:
        with progress.phase("starting buffer and rollout services"):
            buffer = supervisor.add_service(start_service("buffer", {
                "data_dir": str(run_dir / "buffer"), "max_staleness": rl.max_staleness,
                "capacity": rl.buffer_capacity_batches * batch_size, **config.buffer}, log_dir=logs, registry=registry))
            overrides = {"model": str(policy_dir), "engine.seed": config.seed, "buffer": buffer.address,
                         **config.rollout}
            if rl.rollout_replicas > 1:
                replicas = RolloutReplicas(supervisor, overrides, logs, run_dir)
                rollout = replicas.start(rl.rollout_replicas)
            else:
                rollout = supervisor.add_service(start_service("rollout", overrides, log_dir=logs, registry=registry))
        start = success(rollout.address)
        progress.note(f"held-out success at the start of RL: {start['success_rate']:.3f} "
                      f"(mean reward {start['mean_reward']:.3f}, {start['mean_turns']:.2f} turns, "
                      f"{len(eval_tasks)} tasks, greedy)")
        runner_cfg = _write_yaml(run_dir / "runner.yaml", {
            "rollout": rollout.address, "buffer": buffer.address, "env": config.env.name,
            "env_config": config.env.config, "group_size": rl.group_size, "groups_per_batch": rl.groups_per_batch,
            "max_staleness": rl.max_staleness, "temperature": rl.temperature, "max_tokens": config.env.max_tokens,
            "concurrency": concurrency, "seed": config.seed, "stats_path": str(run_dir / "runner_stats.jsonl"),
            # a sample of the groups of episodes, turn by turn, for `relayrl view RUN_DIR`
            "trajectory_log": {"path": str(run_dir / "trajectories.jsonl"), "tokenizer": str(policy_dir)},
        })
        trainer_cfg = _write_yaml(run_dir / "trainer.yaml", {
            "model_path": str(policy_dir),
            "algorithm": {"off_policy": off_policy, **rl.algorithm},
            "optim": {"lr": rl.lr, "warmup_steps": rl.warmup_steps, "max_grad_norm": 1.0},
            "batch": {"global_batch_size": batch_size, "micro_batch_size": batch_size,
                      "max_tokens_per_micro_batch": rl.max_tokens_per_micro_batch},
            "buffer": {"address": buffer.address},
            "max_steps": rl.max_steps,
            "max_staleness": rl.max_staleness,
            # behind a router, the trainer publishes to whichever replicas it lists at each publish
            "publish": {**({"receivers_from": rollout.address} if replicas else {"receivers": [rollout.address]}),
                        "overlap": True},
            "seed": config.seed,
            "log_interval": 10,
            "metrics_path": str(run_dir / "trainer_metrics.jsonl"),
            "checkpoint": {"dir": str(run_dir / "checkpoints"), "interval": rl.checkpoint_interval},
            "heartbeat_path": str(run_dir / "trainer.heartbeat"),
            **config.trainer,
        })
        started = time.monotonic()
        supervisor.add_process("trainer", ["-m", "trainer", "--config", str(trainer_cfg)], logs / "trainer.log",
                               exit_zero_is_done=True, heartbeat=run_dir / "trainer.heartbeat")
        supervisor.add_process("runner", ["-m", "rollout.envs.runner", "--config", str(runner_cfg)],
                               logs / "runner.log", heartbeat=run_dir / "runner_stats.jsonl")
        curve = [_point(run_dir, 0.0, start)]
        board.eval(curve[-1])
        next_eval = started + rl.eval_interval_s
        while True:
            supervisor.check()
            now = time.monotonic()
            if supervisor.done("trainer") or now - started >= rl.time_budget_s:
                break
            if now >= next_eval:
                curve.append(_point(run_dir, time.monotonic() - started, success(rollout.address)))
                board.eval(curve[-1])
                progress.note(_line(curve[-1], rl.time_budget_s))
                next_eval = time.monotonic() + rl.eval_interval_s
            board.tick(time.monotonic() - started)
            time.sleep(0.5)
        rl_seconds = time.monotonic() - started
        for name in ("runner", "trainer"):
            supervisor.stop_member(name)
        curve.append(_point(run_dir, rl_seconds, success(rollout.address)))
        board.eval(curve[-1])
        progress.note(_line(curve[-1], rl.time_budget_s))
        supervisor.check()
    finally:
        if replicas is not None:
            replicas.close()
        supervisor.stop()
        board.close()
    trainer_metrics = _last_records(run_dir / "trainer_metrics.jsonl")
    # Each runner process (a new producer id after a restart) counts from zero: sum their last records.
    episodes = sum({r["producer_id"]: r["episodes"] for r in _last_records(run_dir / "runner_stats.jsonl")}.values())
    summary = AgenticSummary(
        seed=config.seed, env=config.env.name, start_success=start["success_rate"],
        final_success=curve[-1]["success_rate"], best_success=max(p["success_rate"] for p in curve),
        steps=trainer_metrics[-1]["step"] if trainer_metrics else 0, episodes=episodes, sft_seconds=sft_seconds,
        rl_seconds=rl_seconds, total_seconds=time.monotonic() - began, curve=curve,
        restarts=supervisor.restarts(), run_dir=str(run_dir))
    _print_summary(console, summary)
    return summary


def _point(run_dir: pathlib.Path, elapsed: float, evaluation: dict) -> dict:
    """One held-out evaluation with what the trainer and the runner report at that moment (metrics.jsonl)."""
    steps = _last_records(run_dir / "trainer_metrics.jsonl")
    runner = _last_records(run_dir / "runner_stats.jsonl")
    point = {"elapsed_s": round(elapsed, 1), **evaluation, "step": steps[-1]["step"] if steps else 0,
             "train_reward": steps[-1].get("reward_mean") if steps else None,
             "staleness_mean": steps[-1].get("staleness_mean") if steps else None,
             "episodes": runner[-1]["episodes"] if runner else 0,
             "train_success": runner[-1]["success_rate"] if runner else None}
    with open(run_dir / "metrics.jsonl", "a") as out:
        out.write(json.dumps(point) + "\n")
    return point


def _line(point: dict, budget_s: float) -> str:
    return (f"{point['elapsed_s']:.0f}/{budget_s:.0f}s  step {point['step']}  episodes {point['episodes']}  "
            f"held-out success {point['success_rate']:.3f}  mean reward {point['mean_reward']:.3f}  "
            f"turns {point['mean_turns']:.2f}  train reward {point['train_reward'] or 0:.3f}")


def _print_summary(console, summary: AgenticSummary) -> None:
    from rich.table import Table

    table = Table(title=f"relayrl agentic: {summary.env}", show_header=False)
    table.add_column("", style="bold")
    table.add_column("", justify="right")
    for name, value in (
        ("seed", summary.seed),
        ("held-out success, start of RL (after SFT)", f"{summary.start_success:.3f}"),
        ("held-out success, end of RL", f"{summary.final_success:.3f}"),
        ("best held-out success", f"{summary.best_success:.3f}"),
        ("optimizer steps", summary.steps),
        ("episodes played", summary.episodes),
        ("SFT wall-clock", f"{summary.sft_seconds:.0f}s"),
        ("RL wall-clock", f"{summary.rl_seconds:.0f}s"),
        ("total wall-clock", f"{summary.total_seconds:.0f}s"),
        ("restarts", ", ".join(f"{name} {n}" for name, n in summary.restarts.items()) or "none"),
        ("metrics", str(pathlib.Path(summary.run_dir) / "metrics.jsonl")),
    ):
        table.add_row(name, str(value))
    console.print(table)


def main(config_path: str, overrides: list[str] | None = None) -> int:
    from deploy.supervisor import RunFailed
    from services.config import ConfigError

    try:
        config = load_config(AgenticConfig, config_path, overrides or [])
    except ConfigError as exc:
        print(f"relayrl run: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        summary = run_agentic(config)
    except RunFailed as exc:
        print(f"relayrl run failed: {exc}", file=sys.stderr)
        return 1
    return 0 if summary.final_success > summary.start_success else 1
