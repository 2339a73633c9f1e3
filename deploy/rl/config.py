"""The RL phase's plan: its settings (RLConfig), what it serves, trains and measures (Pipeline), and what each of
its processes is told (the buffer's and the rollout's --set overrides, the driver's and the trainer's configs).

A local run (deploy/rl/pipeline.py) starts its processes from these; `relayrl deploy k8s` (deploy/cluster/k8s_configs.py)
renders the same ones into a cluster's ConfigMaps. The settings several services share (group size, max_staleness,
versions per batch) are read once here from RLConfig and handed to each: the buffer, the driver and the trainer
never state them separately.
"""

import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import Field, model_validator

from deploy.experiment.sections import LoggingSection, SuperviseConfig, deterministic_problems
from deploy.experiment.teachers import driver_fields
from deploy.experiment.trainer_fit import merged, nested  # noqa: F401  (the plan's helpers, used from here too)
from services.config import Strict


class RLConfig(Strict):
    """Asynchronous GRPO (or another trainer.config.algorithm.AlgorithmConfig) between the services."""

    time_budget_s: float = Field(360.0, gt=0, description="Wall-clock budget of the RL phase.")
    max_steps: int | None = Field(None, gt=0, description="Also stop after this many optimizer steps (if sooner than "
                                  "the budget); None = the time budget alone ends the phase.")
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
                            description="trainer.config.algorithm.AlgorithmConfig fields (variants: Dr. GRPO, DAPO, ...).")
    publish_overlap: bool = Field(True, description="Send new weights while the next step computes (trainer.config.publish.PublishConfig.overlap).")
    driver_concurrency: int = Field(32, ge=1, description="Prompts the driver keeps in flight (more overlaps RPC latency; staleness stays bounded).")
    checkpoint_interval: int = Field(10, gt=0, description="Trainer checkpoint every this many steps: a restarted "
                                     "trainer resumes from it, and the batches trained since are held in the buffer "
                                     "(leased) until it is saved.")
    buffer_capacity_batches: int = Field(32, gt=0, description="Buffer capacity in batches (pending + leased, "
                                         "including those held until the next checkpoint).")
    metrics_sample_ids: bool = Field(False, description="List each step's sample ids in trainer_metrics.jsonl "
                                     "(audits what was trained, e.g. across restarts).")
    rollout_replicas: int = Field(1, ge=1, description="Rollout processes; more than 1 runs them behind a router "
                                  "(deploy/local/replicas.py) that `relayrl deploy scale rollout N --run RUN_DIR` scales.")
    reward_replicas: int = Field(1, ge=1, description="Reward processes; more than 1 runs reward-1..N, each on its "
                                 "own free port, which the driver and the evaluation reach as one target that gRPC "
                                 "balances round-robin (services.client.replicas_target).")
    deterministic: bool = Field(False, description="Reproduce the run step for step (deploy/experiment/schema.py's "
                                "`deterministic`); needs max_staleness 0 and one rollout process.")

    @model_validator(mode="after")
    def _deterministic(self) -> "RLConfig":
        if self.deterministic and (problems := deterministic_problems(self.max_staleness, self.rollout_replicas)):
            raise ValueError("; ".join(problems))
        return self


@dataclass
class Addresses:
    """Where the services of a run listen (host:port; the reward's may be a gRPC target naming its replicas)."""

    buffer: str
    reward: str
    rollout: str
    teachers: dict[str, str] = field(default_factory=dict)  # distillation's teachers by driver key (deploy/experiment/teachers.py)


@dataclass
class Pipeline:
    """One RL phase: what to serve and train, what to feed the driver, and how to measure the served policy."""

    run_dir: pathlib.Path
    policy_dir: pathlib.Path  # the Hugging Face folder the rollout serves and the trainer trains
    prompts_path: pathlib.Path | None  # the driver's JSONL: prompt_id, prompt, metadata (None: an environment's tasks)
    seed: int
    rl: RLConfig
    supervise: SuperviseConfig
    evaluate: Callable[[Addresses], float]  # a held-out metric of the policy the rollout serves now
    buffer: dict = field(default_factory=dict)  # extra --set overrides of each service
    reward: dict = field(default_factory=dict)
    rollout: dict = field(default_factory=dict)
    teachers: dict[str, dict] = field(default_factory=dict)  # distillation: each teacher's rollout overrides, by key
    reward_env: dict[str, str] | None = None  # environment of the reward service (PYTHONPATH of operator functions)
    driver: dict = field(default_factory=dict)  # extra DriverConfig fields (reward_function, add_bos, ...)
    trainer: dict = field(default_factory=dict)  # extra TrainerConfig fields, merged section by section
    eval_interval_steps: int | None = None  # evaluate every this many optimizer steps instead of eval_interval_s
    # ClientConfig fields by service (buffer, reward, rollout): how every client of the run reaches it (TLS files,
    # token file; deploy/local/security.py); none = plain text, no token
    clients: dict[str, dict] = field(default_factory=dict)
    logging: LoggingSection = field(default_factory=LoggingSection)  # where curves go besides JSONL (deploy/record/loggers.py)
    params: dict = field(default_factory=dict)  # the run's settings, as W&B and MLflow record them

    def client(self, name: str):
        """How the run's clients reach service `name` (services.config.ClientConfig)."""
        from services.config import ClientConfig

        return ClientConfig(**self.clients.get(name, {}))


def driver_config(plan: Pipeline, addresses: Addresses) -> dict:
    """The driver's config (rollout.driver.DriverConfig fields): where the services are, what to generate, and
    the sample of its groups kept in RUN_DIR/trajectories.jsonl for `relayrl view`; plan.driver laid over it."""
    rl = plan.rl
    return merged({
        "rollout": addresses.rollout, "reward": addresses.reward, "buffer": addresses.buffer,
        "prompts": str(plan.prompts_path), "tokenizer": str(plan.policy_dir), "group_size": rl.group_size,
        "groups_per_batch": rl.groups_per_batch, "max_staleness": rl.max_staleness,
        # The trainer advances one weight version per optimizer step, batch.mini_batches of them per batch.
        "versions_per_batch": plan.trainer.get("batch", {}).get("mini_batches", 1),
        "temperature": rl.temperature, "max_tokens": rl.max_tokens, "concurrency": rl.driver_concurrency,
        "seed": plan.seed, "stats_path": str(plan.run_dir / "driver_stats.jsonl"),
        "position_path": str(plan.run_dir / "driver_position.json"),
        "clients": {name: client for name, client in plan.clients.items() if client},
        "trajectory_log": {"path": str(plan.run_dir / "trajectories.jsonl")},
        **({"deterministic": True} if rl.deterministic else {}),
        **driver_fields(addresses.teachers),
    }, plan.driver)


def buffer_overrides(plan: Pipeline) -> dict:
    """`relayrl serve buffer` --set overrides: its log in the run folder, the shared staleness bound, its capacity."""
    rl = plan.rl
    return {"data_dir": str(plan.run_dir / "buffer"), "max_staleness": rl.max_staleness,
            "capacity": rl.buffer_capacity_batches * rl.group_size * rl.groups_per_batch,
            **({"canonical_order": True} if rl.deterministic else {}), **plan.buffer}


def rollout_overrides(plan: Pipeline) -> dict:
    """`relayrl serve rollout` --set overrides: the policy folder and the run's seed (a deterministic run: also the
    engine's deterministic kernels on one thread, unless the rollout's settings name a thread count)."""
    deterministic = {"engine.deterministic": True, "engine.torch_threads": 1} if plan.rl.deterministic else {}
    return {"model": str(plan.policy_dir), "engine.seed": plan.seed, **deterministic, **plan.rollout}


def trainer_config(plan: Pipeline, addresses: Addresses) -> dict:
    """The trainer's config (trainer.config.TrainerConfig fields), plan.trainer laid over it section by section."""
    rl, run_dir = plan.rl, plan.run_dir
    batch_size = rl.group_size * rl.groups_per_batch
    return merged({
        "model_path": str(plan.policy_dir),
        "algorithm": rl.algorithm,
        "optim": {"lr": rl.lr, "warmup_steps": rl.warmup_steps, "max_grad_norm": 1.0},
        "batch": {"global_batch_size": batch_size, "micro_batch_size": batch_size},
        "buffer": {"address": addresses.buffer, "client": plan.clients.get("buffer", {})},
        "max_steps": rl.max_steps,
        "max_staleness": rl.max_staleness,
        "publish": {**({"receivers_from": addresses.rollout} if rl.rollout_replicas > 1 else
                       {"receivers": [addresses.rollout]}), "overlap": rl.publish_overlap,
                    "client": plan.clients.get("rollout", {})},
        "seed": plan.seed,
        **({"deterministic": True} if rl.deterministic else {}),
        "log_interval": 10,
        "metrics_path": str(run_dir / "trainer_metrics.jsonl"),
        "metrics_sample_ids": rl.metrics_sample_ids,
        "checkpoint": {"dir": str(run_dir / "checkpoints"), "interval": rl.checkpoint_interval},
        "heartbeat_path": str(run_dir / "trainer.heartbeat"),
    }, plan.trainer)
