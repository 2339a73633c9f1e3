"""The RL phase every local job shares (the quickstart, an experiment file): services, driver, trainer, evaluation.

    start buffer, reward and rollout as supervised processes -> evaluate the served policy
    -> driver (generate, score, put) and trainer (pull, step, ack, publish) as supervised processes
    -> evaluate every eval_interval_s (or every eval_interval_steps) until the budget or the step count -> stop

A resumed run (`relayrl run --resume`, deploy/run_state.py) goes through the same steps on the same folder: the
buffer recovers its log, the trainer its latest checkpoint and ledger (and publishes its weights at once), the
driver its position; the curve so far (metrics.jsonl) stands for the start evaluation, and the clock goes on
from the RL seconds already spent.

The settings several services share (group size, max_staleness, versions per batch) are read once here from
RLConfig and handed to each: the buffer, the driver and the trainer never state them separately.
"""

import json
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import yaml
from pydantic import Field

from deploy.supervisor import SuperviseConfig
from services.config import Strict


class RLConfig(Strict):
    """Asynchronous GRPO (or another trainer.config.AlgorithmConfig) between the services."""

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
    rollout_replicas: int = Field(1, ge=1, description="Rollout processes; more than 1 runs them behind a router "
                                  "(deploy/replicas.py) that `relayrl deploy scale rollout N --run RUN_DIR` scales.")
    reward_replicas: int = Field(1, ge=1, description="Reward processes; more than 1 runs reward-1..N, each on its "
                                 "own free port, which the driver and the evaluation reach as one target that gRPC "
                                 "balances round-robin (services.client.replicas_target).")


@dataclass
class Addresses:
    """Where the services of a run listen (host:port; the reward's may be a gRPC target naming its replicas)."""

    buffer: str
    reward: str
    rollout: str


@dataclass
class Pipeline:
    """One RL phase: what to serve and train, what to feed the driver, and how to measure the served policy."""

    run_dir: pathlib.Path
    policy_dir: pathlib.Path  # the Hugging Face folder the rollout serves and the trainer trains
    prompts_path: pathlib.Path  # the driver's JSONL: prompt_id, prompt, metadata
    seed: int
    rl: RLConfig
    supervise: SuperviseConfig
    evaluate: Callable[[Addresses], float]  # a held-out metric of the policy the rollout serves now
    buffer: dict = field(default_factory=dict)  # extra --set overrides of each service
    reward: dict = field(default_factory=dict)
    rollout: dict = field(default_factory=dict)
    reward_env: dict[str, str] | None = None  # environment of the reward service (PYTHONPATH of operator functions)
    driver: dict = field(default_factory=dict)  # extra DriverConfig fields (reward_function, add_bos, ...)
    trainer: dict = field(default_factory=dict)  # extra TrainerConfig fields, merged section by section
    eval_interval_steps: int | None = None  # evaluate every this many optimizer steps instead of eval_interval_s
    # ClientConfig fields by service (buffer, reward, rollout): how every client of the run reaches it (TLS files,
    # token file; deploy/run_security.py); none = plain text, no token
    clients: dict[str, dict] = field(default_factory=dict)

    def client(self, name: str):
        """How the run's clients reach service `name` (services.config.ClientConfig)."""
        from services.config import ClientConfig

        return ClientConfig(**self.clients.get(name, {}))


@dataclass
class PipelineResult:
    start_metric: float
    final_metric: float
    curve: list[dict]
    rl_seconds: float
    steps: int
    completions: int
    restarts: dict[str, int]


def write_yaml(path: pathlib.Path, data: dict) -> pathlib.Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def read_jsonl(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def merged(base: dict, extra: dict) -> dict:
    """`base` with `extra` laid over it, section by section (nested dicts merged, anything else replaced)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def nested(overrides: dict) -> dict:
    """{'engine.dtype': 'bfloat16'} -> {'engine': {'dtype': 'bfloat16'}}, as `--set` applies them."""
    from services.config import apply_override

    out: dict = {}
    for key, value in overrides.items():
        apply_override(out, key.split("."), value)
    return out


def _latest_step(path: pathlib.Path) -> int:
    """The last optimizer step in the trainer's metrics file (0 before the first)."""
    if not path.exists():
        return 0
    with open(path, "rb") as file:
        file.seek(0, 2)
        file.seek(max(0, file.tell() - 8192))
        lines = [line for line in file.read().splitlines() if line.strip()]
    return json.loads(lines[-1]).get("step", 0) if lines else 0


def driver_config(plan: Pipeline, addresses: Addresses) -> dict:
    rl = plan.rl
    return {
        "rollout": addresses.rollout, "reward": addresses.reward, "buffer": addresses.buffer,
        "prompts": str(plan.prompts_path), "tokenizer": str(plan.policy_dir), "group_size": rl.group_size,
        "groups_per_batch": rl.groups_per_batch, "max_staleness": rl.max_staleness,
        # The trainer advances one weight version per optimizer step, batch.mini_batches of them per batch.
        "versions_per_batch": plan.trainer.get("batch", {}).get("mini_batches", 1),
        "temperature": rl.temperature, "max_tokens": rl.max_tokens, "concurrency": rl.driver_concurrency,
        "seed": plan.seed, "stats_path": str(plan.run_dir / "driver_stats.jsonl"),
        "position_path": str(plan.run_dir / "driver_position.json"),
        "clients": {name: client for name, client in plan.clients.items() if client}, **plan.driver,
    }


def buffer_overrides(plan: Pipeline) -> dict:
    """`relayrl serve buffer` --set overrides: its log in the run folder, the shared staleness bound, its capacity."""
    rl = plan.rl
    return {"data_dir": str(plan.run_dir / "buffer"), "max_staleness": rl.max_staleness,
            "capacity": rl.buffer_capacity_batches * rl.group_size * rl.groups_per_batch, **plan.buffer}


def rollout_overrides(plan: Pipeline) -> dict:
    """`relayrl serve rollout` --set overrides: the policy folder and the run's seed."""
    return {"model": str(plan.policy_dir), "engine.seed": plan.seed, **plan.rollout}


def trainer_config(plan: Pipeline, addresses: Addresses) -> dict:
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
        "log_interval": 10,
        "metrics_path": str(run_dir / "trainer_metrics.jsonl"),
        "metrics_sample_ids": rl.metrics_sample_ids,
        "checkpoint": {"dir": str(run_dir / "checkpoints"), "interval": rl.checkpoint_interval},
        "heartbeat_path": str(run_dir / "trainer.heartbeat"),
    }, plan.trainer)


def wait_for_published_weights(rollout: str, supervisor, timeout_s: float, client=None) -> None:
    """Until the rollout serves weights a trainer published (a resumed trainer publishes its checkpoint's as it
    starts; until then a restarted rollout serves the base folder's, at version 0), the trainer ends, or
    `timeout_s` passes (then the run goes on: evaluations meanwhile see older weights). `client`: how to reach the
    rollout (services.config.ClientConfig)."""
    import grpc

    from protos import rollout_pb2, rollout_pb2_grpc
    from services.client import connect_sync

    deadline = time.monotonic() + timeout_s
    with connect_sync(rollout, client) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        while time.monotonic() < deadline and not supervisor.done("trainer"):
            supervisor.check()
            try:
                if stub.GetWeightVersion(rollout_pb2.GetWeightVersionRequest(), timeout=5).version > 0:
                    return
            except grpc.RpcError:
                pass  # restarting: the supervisor sees to it
            time.sleep(0.5)


def start_reward(plan: Pipeline, supervisor, launcher, logs: pathlib.Path, registry: pathlib.Path) -> str:
    """Start the reward service under `supervisor`; the target its clients call. With rl.reward_replicas > 1 it runs
    as processes reward-1..N, each supervised and restarted on its own address like any service; scoring is
    stateless, so no router stands in front of them: the target names them all and each client's channel spreads
    its calls round-robin over those that answer (services/client.py)."""
    from services.client import replicas_target

    count = plan.rl.reward_replicas
    if count > 1 and "server.address" in plan.reward:
        raise ValueError(f"reward: {count} replicas cannot share the fixed address {plan.reward['server.address']} "
                         "(each replica takes a free port)")
    labels = ["reward"] if count == 1 else [f"reward-{i}" for i in range(1, count + 1)]
    processes = [supervisor.add_service(launcher.service("reward", plan.reward, logs, registry, plan.reward_env,
                                                         label=label, client=plan.client("reward")))
                 for label in labels]
    return replicas_target([process.address for process in processes])


def run_pipeline(plan: Pipeline, progress, supervisor, launcher=None) -> PipelineResult:
    """Run the RL phase under `supervisor` (deploy.supervisor.Supervisor), reporting to `progress`
    (deploy.progress.Progress); the caller stops the supervisor. `launcher` starts the processes (LocalLauncher
    by default)."""
    from deploy.local_launcher import LocalLauncher
    from deploy.replicas import RolloutReplicas
    from deploy.run_state import rl_seconds, save_rl_seconds
    from deploy.service_registry import REGISTRY_FILE
    from deploy.status import run_targets
    from deploy.tensorboard import RunBoard
    from trainer.checkpoint import latest_checkpoint

    launcher = launcher or LocalLauncher()
    rl, run_dir = plan.rl, plan.run_dir
    registry = run_dir / REGISTRY_FILE  # where `relayrl status RUN_DIR` finds the services
    logs = run_dir / "logs"
    board = RunBoard(run_dir, "driver", lambda: run_targets(run_dir))
    earlier = read_jsonl(run_dir / "metrics.jsonl")  # the curve of a resumed run so far
    replicas = None  # RolloutReplicas when the rollout runs as replicas behind a router
    try:
        with progress.phase("starting buffer, reward and rollout services"):
            buffer = supervisor.add_service(launcher.service("buffer", buffer_overrides(plan), logs, registry,
                                                             client=plan.client("buffer")))
            reward = start_reward(plan, supervisor, launcher, logs, registry)
            if rl.rollout_replicas > 1:
                replicas = RolloutReplicas(supervisor, rollout_overrides(plan), logs, run_dir, launcher,
                                           client=plan.client("rollout"))
                rollout = replicas.start(rl.rollout_replicas)
            else:
                rollout = supervisor.add_service(launcher.service("rollout", rollout_overrides(plan), logs, registry,
                                                                  client=plan.client("rollout")))
        addresses = Addresses(buffer=buffer.address, reward=reward, rollout=rollout.address)
        if earlier:
            start_metric, spent = earlier[0]["accuracy"], rl_seconds(run_dir)
            progress.trainer.drain()  # the steps before the resume are in the earlier points' means
            progress.note(f"resuming RL at {spent:.0f}s of {rl.time_budget_s:.0f}s (held-out metric at the start "
                          f"of RL: {start_metric:.3f}, at the last evaluation: {earlier[-1]['accuracy']:.3f})")
        else:
            start_metric, spent = plan.evaluate(addresses), 0.0
            progress.note(f"held-out metric at the start of RL: {start_metric:.3f}")

        driver_cfg = write_yaml(run_dir / "driver.yaml", driver_config(plan, addresses))
        # The versions the killed job's trainers published are lost with its rollout (and the buffer may not have
        # heard of the last ones): a resumed trainer continues above every version its step records name.
        used = max((r["weight_version"] for r in read_jsonl(run_dir / "trainer_metrics.jsonl")), default=0)
        trainer_cfg = write_yaml(run_dir / "trainer.yaml", merged(merged(trainer_config(plan, addresses),
                                                                          launcher.trainer_settings()),
                                                                   {"publish": {"versions_above": used}}))
        started = time.monotonic() - spent
        supervisor.add(launcher.process("trainer", ["-m", "trainer", "--config", str(trainer_cfg)],
                                        logs / "trainer.log", exit_zero_is_done=True,
                                        heartbeat=run_dir / "trainer.heartbeat"))
        supervisor.add(launcher.process("driver", ["-m", "rollout.driver", "--config", str(driver_cfg)],
                                        logs / "driver.log", heartbeat=run_dir / "driver_stats.jsonl"))
        if earlier and latest_checkpoint(run_dir / "checkpoints") is not None:
            wait_for_published_weights(addresses.rollout, supervisor, plan.supervise.start_timeout_s,
                                       plan.client("rollout"))
        progress.start_rl(rl.time_budget_s, start_metric)
        curve = earlier or [progress.point(0.0, start_metric)]
        board.eval(curve[-1])
        next_eval_at, next_eval_step = started + rl.eval_interval_s, plan.eval_interval_steps or 0
        metrics_path = run_dir / "trainer_metrics.jsonl"
        while True:
            supervisor.check()  # RunFailed: something kept dying
            now = time.monotonic()
            save_rl_seconds(run_dir, now - started)
            if supervisor.done("trainer") or now - started >= rl.time_budget_s:
                break
            if plan.eval_interval_steps:
                due = _latest_step(metrics_path) >= next_eval_step
            else:
                due = now >= next_eval_at
            if due:
                next_eval_at = now + rl.eval_interval_s
                next_eval_step = _latest_step(metrics_path) + (plan.eval_interval_steps or 0)
                point = progress.point(time.monotonic() - started, plan.evaluate(addresses))
                curve.append(point)
                board.eval(point)
            progress.refresh(time.monotonic() - started)
            board.tick(time.monotonic() - started)
            time.sleep(0.5)
        rl_seconds_spent = time.monotonic() - started
        save_rl_seconds(run_dir, rl_seconds_spent)
        for name in ("driver", "trainer"):
            supervisor.stop_member(name)
        final = plan.evaluate(addresses)
        curve.append(progress.point(rl_seconds_spent, final))
        board.eval(curve[-1])
        supervisor.check()
    finally:
        board.close()
        if replicas is not None:
            replicas.close()
    trainer_metrics = read_jsonl(metrics_path)
    driver_stats = read_jsonl(run_dir / "driver_stats.jsonl")
    # Each driver process (a new producer id after a restart) counts from zero: sum their last records.
    completions = sum({d.get("producer_id"): d["samples"] for d in driver_stats}.values())
    return PipelineResult(start_metric=start_metric, final_metric=final, curve=curve, rl_seconds=rl_seconds_spent,
                          steps=trainer_metrics[-1]["step"] if trainer_metrics else 0, completions=completions,
                          restarts=supervisor.restarts())
