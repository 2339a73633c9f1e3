"""The RL phase of an experiment file's run (the quickstart's too): services, driver, trainer, evaluation.

    start buffer, reward and rollout as supervised processes -> evaluate the served policy
    -> driver (generate, score, put) and trainer (pull, step, ack, publish) as supervised processes
    -> evaluate every eval_interval_s (or every eval_interval_steps) until the budget or the step count -> stop

What each process is told comes from the plan (deploy/rl/config.py); this module starts and watches them.
A resumed run (`relayrl run --resume`, deploy/record/run_state.py) goes through the same steps on the same folder: the
buffer recovers its log, the trainer its latest checkpoint and ledger (and publishes its weights at once), the
driver its position; the curve so far (metrics.jsonl) stands for the start evaluation, and the clock goes on
from the RL seconds already spent.
"""

import json
import pathlib
import time
from dataclasses import dataclass

import yaml

from deploy.experiment.teachers import start_teachers
from deploy.local.launcher import LocalLauncher
from deploy.local.replicas import RolloutReplicas
from deploy.rl.config import (
    Addresses,
    Pipeline,
    buffer_overrides,
    driver_config,
    merged,
    rollout_overrides,
    trainer_config,
)

TRAINER_STOP_S = 120.0  # a stopped trainer's last publish and checkpoint, before it is killed


@dataclass
class PipelineResult:
    """What one RL phase reached: the held-out metric at its start, at its end and over time (None: not measured),
    and the work done."""

    start_metric: float | None
    final_metric: float | None
    curve: list[dict]
    rl_seconds: float
    steps: int
    completions: int
    restarts: dict[str, int]

    def summary(self, seed: int, run_dir: pathlib.Path):
        """The run's deploy.record.run_state.Summary (its accuracy fields hold the held-out metric)."""
        from deploy.record.run_state import Summary

        return Summary(
            seed=seed, sft_accuracy=self.start_metric, final_accuracy=self.final_metric,
            best_accuracy=max((p["accuracy"] for p in self.curve), default=None), steps=self.steps,
            completions=self.completions, rl_seconds=self.rl_seconds, curve=self.curve, run_dir=str(run_dir),
            restarts=self.restarts,
        )


def recorded_result(run_dir: pathlib.Path, restarts: dict[str, int]) -> PipelineResult:
    """What an RL phase that failed part-way had reached, read from the files its processes wrote: the held-out points
    measured, the trainer's last step, the completions (or an environment's episodes) made, the RL clock."""
    from deploy.record.run_state import rl_seconds

    curve = read_jsonl(run_dir / "metrics.jsonl")
    return PipelineResult(start_metric=curve[0]["accuracy"] if curve else None,
                          final_metric=curve[-1]["accuracy"] if curve else None, curve=curve,
                          rl_seconds=rl_seconds(run_dir), steps=last_step(run_dir), completions=completions(run_dir),
                          restarts=restarts)


def last_step(run_dir: pathlib.Path) -> int:
    """The trainer's last optimizer step recorded (0: none)."""
    trainer_metrics = read_jsonl(run_dir / "trainer_metrics.jsonl")
    return trainer_metrics[-1]["step"] if trainer_metrics else 0


def completions(run_dir: pathlib.Path) -> int:
    """Completions the driver made (an environment's episodes, by its runner). Each process (a new producer id after a
    restart) counts from zero: their last records are summed."""
    if (run_dir / "runner_stats.jsonl").exists():
        return sum({r["producer_id"]: r["episodes"] for r in read_jsonl(run_dir / "runner_stats.jsonl")}.values())
    return sum({d.get("producer_id"): d["samples"] for d in read_jsonl(run_dir / "driver_stats.jsonl")}.values())


def run_pipeline(plan: Pipeline, progress, supervisor, launcher=None) -> PipelineResult:
    """Run the RL phase under `supervisor` (deploy.local.supervisor.Supervisor), reporting to `progress`
    (deploy.record.progress.Progress); the caller stops the supervisor. `launcher` starts the processes (LocalLauncher
    by default)."""
    from deploy.record.loggers import writers
    from deploy.record.status import run_targets
    from deploy.record.tensorboard import RunBoard

    launcher = launcher or LocalLauncher()
    run_dir = plan.run_dir
    supervisor.record_events(run_dir / "supervisor.jsonl")  # what died and restarted, for `relayrl doctor RUN_DIR`
    board = RunBoard(run_dir, "driver", lambda: run_targets(run_dir),
                     writers=writers(plan.logging, run_dir, plan.params))
    earlier = read_jsonl(run_dir / "metrics.jsonl")  # the curve of a resumed run so far
    replicas = None  # RolloutReplicas when the rollout runs as replicas behind a router
    if plan.rl.rollout_replicas > 1:
        replicas = RolloutReplicas(supervisor, rollout_overrides(plan), run_dir / "logs", run_dir, launcher,
                                   client=plan.client("rollout"))
    try:
        with progress.phase("starting buffer, reward and rollout services"):
            addresses = start_services(plan, supervisor, launcher, replicas)
        start_metric, spent = measure_start(plan, progress, addresses, earlier)
        started = start_driver_and_trainer(plan, supervisor, launcher, addresses, spent, resumed=bool(earlier))
        progress.start_rl(plan.rl.time_budget_s, start_metric)
        curve = earlier or [progress.point(0.0, start_metric)]
        board.eval(curve[-1])
        run_rl(plan, supervisor, progress, board, addresses, started, curve)
        rl_seconds = stop_driver_and_trainer(plan, supervisor, started)
        final = plan.evaluate(addresses)
        curve.append(progress.point(rl_seconds, final))
        board.eval(curve[-1])
        supervisor.check()
    finally:
        board.close()
        if replicas is not None:
            replicas.close()
    return pipeline_result(plan, supervisor, start_metric, final, curve, rl_seconds)


# ---------------------------------------------------------------- the steps


def start_services(plan: Pipeline, supervisor, launcher, replicas) -> Addresses:
    """Buffer, reward and rollout (`replicas`: the rollout as replicas behind a router), and distillation's teachers,
    each supervised and recorded in the run's services.json (where `relayrl status RUN_DIR` finds them); where they
    listen."""
    from deploy.record.service_registry import REGISTRY_FILE

    registry, logs = plan.run_dir / REGISTRY_FILE, plan.run_dir / "logs"
    buffer = supervisor.add_service(launcher.service("buffer", buffer_overrides(plan), logs, registry,
                                                     client=plan.client("buffer")))
    reward = start_reward(plan, supervisor, launcher, logs, registry)
    if replicas is not None:
        rollout = replicas.start(plan.rl.rollout_replicas)
    else:
        rollout = supervisor.add_service(launcher.service("rollout", rollout_overrides(plan), logs, registry,
                                                          client=plan.client("rollout")))
    teachers = start_teachers(plan, supervisor, launcher, logs, registry)  # distillation's, if any
    return Addresses(buffer=buffer.address, reward=reward, rollout=rollout.address, teachers=teachers)


def measure_start(plan: Pipeline, progress, addresses: Addresses, earlier: list[dict]) -> tuple[float, float]:
    """(The held-out metric at the start of RL, the RL seconds already spent): the served policy evaluated now, or a
    resumed run's (`earlier`: its curve so far) first point and clock."""
    from deploy.record.run_state import rl_seconds

    if not earlier:
        start_metric = plan.evaluate(addresses)
        progress.note(f"held-out metric at the start of RL: {start_metric:.3f}")
        return start_metric, 0.0
    start_metric, spent = earlier[0]["accuracy"], rl_seconds(plan.run_dir)
    progress.trainer.drain()  # the steps before the resume are in the earlier points' means
    progress.note(f"resuming RL at {spent:.0f}s of {plan.rl.time_budget_s:.0f}s (held-out metric at the start "
                  f"of RL: {start_metric:.3f}, at the last evaluation: {earlier[-1]['accuracy']:.3f})")
    return start_metric, spent


def start_driver_and_trainer(plan: Pipeline, supervisor, launcher, addresses: Addresses, spent: float,
                             resumed: bool) -> float:
    """Write their configs, start both supervised, and (a resumed run with a checkpoint) wait until the rollout
    serves the resumed trainer's weights; the time.monotonic() at which RL started, less the `spent` seconds."""
    from trainer.checkpoint import latest_checkpoint

    run_dir, logs = plan.run_dir, plan.run_dir / "logs"
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
    if resumed and latest_checkpoint(run_dir / "checkpoints") is not None:
        wait_for_published_weights(addresses.rollout, supervisor, plan.supervise.start_timeout_s,
                                   plan.client("rollout"))
    return started


def run_rl(plan: Pipeline, supervisor, progress, board, addresses: Addresses, started: float,
           curve: list[dict]) -> None:
    """While the driver and the trainer run: until the time budget is spent or the trainer ends (its step count),
    the served policy evaluated every eval_interval_s (or every eval_interval_steps) onto `curve`, progress shown,
    the RL clock saved for a resume. RunFailed when a process keeps dying. A deterministic run evaluates only before
    and after: greedy requests beside a step's would change how the rollout batches (and so computes) its groups."""
    from deploy.record.run_state import save_rl_seconds

    rl, run_dir = plan.rl, plan.run_dir
    metrics_path = run_dir / "trainer_metrics.jsonl"
    next_eval_at, next_eval_step = started + rl.eval_interval_s, plan.eval_interval_steps or 0
    if rl.deterministic:
        progress.note("deterministic run: the held-out metric is measured at the start and the end of RL only")
    while True:
        supervisor.check()  # RunFailed: something kept dying
        now = time.monotonic()
        save_rl_seconds(run_dir, now - started)
        if supervisor.done("trainer") or now - started >= rl.time_budget_s:
            return
        if rl.deterministic:
            due = False
        elif plan.eval_interval_steps:
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


def stop_driver_and_trainer(plan: Pipeline, supervisor, started: float) -> float:
    """The RL seconds spent (saved for a resume), then the driver and the trainer stopped."""
    from deploy.record.run_state import save_rl_seconds

    spent = time.monotonic() - started
    save_rl_seconds(plan.run_dir, spent)
    supervisor.stop_member("driver")
    # On SIGTERM the trainer ends its step, publishes, checkpoints and exports what it ended with: time to do so.
    supervisor.stop_member("trainer", TRAINER_STOP_S)
    return spent


def pipeline_result(plan: Pipeline, supervisor, start_metric: float, final: float, curve: list[dict],
                    rl_seconds: float) -> PipelineResult:
    """The phase's numbers: its curve, the trainer's last step, the completions every driver process made."""
    return PipelineResult(start_metric=start_metric, final_metric=final, curve=curve, rl_seconds=rl_seconds,
                          steps=last_step(plan.run_dir), completions=completions(plan.run_dir),
                          restarts=supervisor.restarts())


# ---------------------------------------------------------------- the services and files they share


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


def write_yaml(path: pathlib.Path, data: dict) -> pathlib.Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def read_jsonl(path: pathlib.Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _latest_step(path: pathlib.Path) -> int:
    """The last optimizer step in the trainer's metrics file (0 before the first)."""
    if not path.exists():
        return 0
    with open(path, "rb") as file:
        file.seek(0, 2)
        file.seek(max(0, file.tell() - 8192))
        lines = [line for line in file.read().splitlines() if line.strip()]
    return json.loads(lines[-1]).get("step", 0) if lines else 0
