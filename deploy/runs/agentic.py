"""An experiment file with `env` (`relayrl run examples/agentic/*.yaml`): a model learns an environment by RL.

    the model (model.path, or model.tiny built in RUN_DIR/model-init) -> SFT warm-up on transcripts a scripted player
    plays (rollout/envs/transcripts.py) -> buffer and rollout as supervised processes (the rollout submits closed
    sessions to the buffer) -> the episode runner (sessions, admission control) and the trainer (GRPO over the
    episodes of a task) -> held-out success rate (greedy episodes through sessions) every evaluation.every_s
    -> the weights exported, a summary table (summary.json), a plot, metrics JSONL

The environment makes its tasks and scores its episodes, so no reward service runs, and the episode runner takes
the driver's place. What the buffer, the rollout and the trainer are told is a prompt run's plan
(deploy/rl/plan.py pipeline_plan); `agentic_configs` adds the runner's config and the environment's rule for
off-policy correction. A run of this kind cannot be resumed yet (it keeps no RL clock).
"""

import asyncio
import pathlib
import time

from deploy.experiment.schema import ExperimentConfig
from deploy.rl.config import Addresses, Pipeline


def env_tasks(config: ExperimentConfig) -> tuple[list, list]:
    """(train, held-out) tasks the environment makes from its config and the run's seed."""
    from rollout.envs.runner import env_spec

    env_cls, env_config = env_spec(config.env.name, config.env.config)
    return env_cls.tasks(env_config, config.seed)


def describe_env(config: ExperimentConfig) -> str:
    """What the environment gives a run (for `relayrl doctor`): its tasks and how long a policy turn may be."""
    train, held_out = env_tasks(config)
    same = {task.task_id for task in train} == {task.task_id for task in held_out}
    tasks = (f"the same {len(train)} tasks train and are evaluated (the policy never sees what they hide)" if same
             else f"{len(train)} train tasks, {len(held_out)} held out")
    return (f"{config.env.name}: {tasks}, {config.env.eval_concurrency} greedy episodes at a time; policy turns of "
            f"at most {config.training.max_tokens} tokens (training.max_tokens); reward from the environment")


def algorithm(config: ExperimentConfig) -> dict:
    """The trainer's algorithm: the file's, with off_policy bypass when max_staleness > 0 unless the file sets it
    (the PPO ratio against the rollout's logprobs, clipped: the stale samples' importance ratio with a trust region).
    tis/decoupled take the ratio against the step's own start, which one optimizer step per batch never clips: on the
    tool-use task at max_staleness 2 that collapsed to garbage within ~20 steps (docs/agentic.md)."""
    fields = config.algorithm.model_dump(mode="json")
    if (config.training.max_staleness > 0 and "off_policy" not in config.algorithm.model_fields_set
            and config.algorithm.name in ("grpo", "ppo")):
        fields["off_policy"] = "bypass"
    return fields


def agentic_plan(config: ExperimentConfig, run_dir: pathlib.Path, policy_dir: pathlib.Path) -> Pipeline:
    """The run's plan: the buffer's, the rollout's and the trainer's settings as a prompt run's, with no prompts."""
    from deploy.rl.plan import pipeline_plan

    plan = pipeline_plan(config, run_dir, policy_dir, prompts_path=None)
    plan.rl.algorithm = algorithm(config)
    return plan


def agentic_configs(config: ExperimentConfig, plan: Pipeline, addresses: Addresses) -> tuple[dict, dict]:
    """(The episode runner's config: rollout.envs.runner.RunnerConfig fields, the trainer's: TrainerConfig fields), of
    the run's plan (agentic_plan)."""
    from deploy.rl.config import trainer_config

    training, run_dir, policy_dir = config.training, plan.run_dir, plan.policy_dir
    runner = {
        "rollout": addresses.rollout, "buffer": addresses.buffer, "env": config.env.name,
        "env_config": config.env.config, "episode_retries": config.env.episode_retries,
        "group_size": training.group_size,
        "groups_per_batch": training.groups_per_batch, "max_staleness": training.max_staleness,
        "versions_per_batch": training.mini_batches,  # one weight version per optimizer step
        "temperature": training.temperature, "max_tokens": training.max_tokens, "concurrency": config.concurrency,
        "seed": config.seed, "stats_path": str(run_dir / "runner_stats.jsonl"),
        "position_path": str(run_dir / "runner_position.json"),  # a restarted runner goes on in the task stream
        # a sample of the groups of episodes, turn by turn, for `relayrl view RUN_DIR`
        "trajectory_log": {"path": str(run_dir / "trajectories.jsonl"), "tokenizer": str(policy_dir),
                           **config.trajectory_log.model_dump()},
    }
    return runner, trainer_config(plan, addresses)


def warm_up(config: ExperimentConfig, model_dir: pathlib.Path, run_dir: pathlib.Path, train_tasks,
            progress) -> pathlib.Path:
    """The policy RL starts from: `model_dir`, or with sft.steps its warm-up in RUN_DIR/model-sft on sft.transcripts
    episodes a scripted player plays over the train tasks (the loss on the player's turns)."""
    from transformers import AutoTokenizer

    from deploy.experiment.warmup import supervised_warmup
    from rollout.envs.transcripts import transcripts

    sft = config.sft
    if not sft.steps:
        return model_dir
    policy_dir = run_dir / "model-sft"
    with progress.phase(f"SFT warm-up: {sft.steps} steps of {sft.batch_size} {config.env.name} transcripts"):
        samples = transcripts(AutoTokenizer.from_pretrained(model_dir), config.env.name, config.env.config,
                              train_tasks, sft.transcripts, sft.skill, config.seed)
        supervised_warmup(model_dir, policy_dir, samples, sft.steps, sft.batch_size, sft.lr, config.seed,
                          log_interval=25)
    return policy_dir


def run_agentic(config: ExperimentConfig, console=None, supervisor=None):
    """The whole run of an experiment with `env`; returns deploy.record.run_state.Summary (its accuracy fields hold the
    held-out success rate). `supervisor` (deploy.local.supervisor.Supervisor) lets a caller watch its processes."""
    import torch

    from deploy.local.supervisor import Supervisor
    from deploy.record.progress import Progress
    from deploy.record.run_state import start_run_dir
    from deploy.rl.plan import base_model, finish_run

    torch.set_num_threads(1)
    run_dir = pathlib.Path(config.run_dir)
    start_run_dir(run_dir, config.model_dump(mode="json"), config.seed, resume=False)
    progress = Progress(run_dir, console, title=f"relayrl run {run_dir.name} ({config.env.name})", producer="runner")
    train_tasks, eval_tasks = env_tasks(config)
    policy_dir = warm_up(config, base_model(config, run_dir, resume=False), run_dir, train_tasks, progress)
    supervisor = supervisor or Supervisor(config.supervise)
    supervisor.record_events(run_dir / "supervisor.jsonl")  # what died and restarted, for `relayrl doctor RUN_DIR`
    plan = agentic_plan(config, run_dir, policy_dir)
    return finish_run(config, run_dir, policy_dir, progress, supervisor,
                      lambda: _rl(config, plan, eval_tasks, progress, supervisor))


def _rl(config: ExperimentConfig, plan: Pipeline, eval_tasks, progress, supervisor):
    """Buffer and rollout, then the runner and the trainer until the budget or max_steps, the held-out success rate
    measured at the start, every evaluation.every_s (or every_steps) and at the end; a deploy.rl.pipeline.PipelineResult."""
    from deploy.local.launcher import LocalLauncher
    from deploy.local.replicas import RolloutReplicas
    from deploy.record.loggers import writers
    from deploy.record.service_registry import REGISTRY_FILE
    from deploy.record.status import run_targets
    from deploy.record.tensorboard import RunBoard
    from deploy.rl.config import buffer_overrides, rollout_overrides
    from deploy.rl.pipeline import (
        TRAINER_STOP_S,
        PipelineResult,
        completions,
        last_step,
        write_yaml,
    )
    from rollout.envs.runner import evaluate

    run_dir, launcher = plan.run_dir, LocalLauncher()
    logs, registry = run_dir / "logs", run_dir / REGISTRY_FILE  # services.json: where `relayrl status` finds them
    training, evaluation = config.training, config.evaluation
    eval_tokens = evaluation.max_tokens or training.max_tokens
    board = RunBoard(run_dir, "runner", lambda: run_targets(run_dir),
                     writers=writers(plan.logging, run_dir, plan.params))
    replicas = None  # RolloutReplicas when the rollout runs as replicas behind a router
    try:
        with progress.phase("starting buffer and rollout services"):
            buffer = supervisor.add_service(launcher.service("buffer", buffer_overrides(plan), logs, registry))
            plan.rollout = {"buffer": buffer.address, **plan.rollout}  # where closed sessions are submitted
            if plan.rl.rollout_replicas > 1:
                replicas = RolloutReplicas(supervisor, rollout_overrides(plan), logs, run_dir, launcher)
                rollout = replicas.start(plan.rl.rollout_replicas)
            else:
                rollout = supervisor.add_service(launcher.service("rollout", rollout_overrides(plan), logs, registry))

        def point(elapsed: float) -> dict:
            measured = asyncio.run(evaluate(rollout.address, config.env.name, config.env.config, eval_tasks,
                                            eval_tokens, config.env.eval_concurrency))
            runner = progress.driver.latest()
            done = progress.point(elapsed, measured["success_rate"], **measured,
                                  train_success=runner.get("success_rate"))
            board.eval(done)
            progress.note(f"{elapsed:.0f}/{training.time_budget_s:.0f}s  step {done['step']}  episodes "
                          f"{done['completions']}  held-out success {measured['success_rate']:.3f}  mean reward "
                          f"{measured['mean_reward']:.3f}  turns {measured['mean_turns']:.2f}  ({len(eval_tasks)} "
                          "tasks, greedy)")
            return done

        curve = [point(0.0)]
        addresses = Addresses(buffer=buffer.address, reward="", rollout=rollout.address)  # no reward service
        runner_cfg, trainer_cfg = agentic_configs(config, plan, addresses)
        started = time.monotonic()
        supervisor.add(launcher.process("trainer", ["-m", "trainer", "--config",
                                                    str(write_yaml(run_dir / "trainer.yaml", trainer_cfg))],
                                        logs / "trainer.log", exit_zero_is_done=True,
                                        heartbeat=run_dir / "trainer.heartbeat"))
        supervisor.add(launcher.process("runner", ["-m", "rollout.envs.runner", "--config",
                                                   str(write_yaml(run_dir / "runner.yaml", runner_cfg))],
                                        logs / "runner.log", heartbeat=run_dir / "runner_stats.jsonl"))
        progress.start_rl(training.time_budget_s, curve[0]["accuracy"])
        next_eval_at, next_eval_step = started + evaluation.every_s, evaluation.every_steps or 0
        while True:
            supervisor.check()  # RunFailed: something kept dying
            now = time.monotonic()
            if supervisor.done("trainer") or now - started >= training.time_budget_s:
                break
            step = progress.trainer.latest().get("step", 0)
            due = step >= next_eval_step if evaluation.every_steps else now >= next_eval_at
            if due:
                curve.append(point(now - started))
                next_eval_at = time.monotonic() + evaluation.every_s
                next_eval_step = step + (evaluation.every_steps or 0)
            progress.refresh(time.monotonic() - started)
            board.tick(time.monotonic() - started)
            time.sleep(0.5)
        rl_seconds = time.monotonic() - started
        supervisor.stop_member("runner")
        # On SIGTERM the trainer ends its step, publishes and checkpoints what it ended with: time to do so.
        supervisor.stop_member("trainer", TRAINER_STOP_S)
        curve.append(point(rl_seconds))
        supervisor.check()
    finally:
        board.close()
        if replicas is not None:
            replicas.close()
    return PipelineResult(start_metric=curve[0]["accuracy"], final_metric=curve[-1]["accuracy"], curve=curve,
                          rl_seconds=rl_seconds, steps=last_step(run_dir), completions=completions(run_dir),
                          restarts=supervisor.restarts())
