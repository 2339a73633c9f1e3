"""What an experiment file tells each process of its run (the plan), the model folder the run starts from, and the
weights it ends with exported: the pieces a run on prompts (deploy/runs/experiment_run.py) and a run on an environment's
episodes (deploy/runs/agentic.py) share; `relayrl deploy k8s` (deploy/cluster/k8s_configs.py) renders the same plan.
"""

import os
import pathlib

from deploy.experiment.schema import ExperimentConfig

REWARD_NAME = "experiment"  # the name an operator function or reward model is served under in the run


def reward_service(config: ExperimentConfig) -> tuple[dict, dict[str, str], str]:
    """(reward service overrides, its environment, the function name the driver asks for)."""
    from reward.registry import BUILTINS

    reward = config.reward
    env = {"PYTHONPATH": os.pathsep.join([*reward.python_path, *filter(None, [os.environ.get("PYTHONPATH")])])}
    overrides = _placement(config, "reward")
    if reward.model is not None:
        overrides[f"reward_models.{REWARD_NAME}"] = {"path": reward.model}
        return overrides, env, REWARD_NAME
    if reward.judge is not None:
        overrides[f"judges.{REWARD_NAME}"] = reward.judge.model_dump(mode="json")
        return overrides, env, REWARD_NAME
    if not reward.custom:
        return overrides, env, reward.function
    target = BUILTINS[reward.function].target if reward.function in BUILTINS else reward.function
    overrides[f"functions.{REWARD_NAME}"] = {"target": target, "args": reward.args}
    return overrides, env, REWARD_NAME


def _placement(config: ExperimentConfig, name: str) -> dict:
    placement = getattr(config.services, name)
    fixed = {"server.address": f"127.0.0.1:{placement.port}"} if placement.port else {}
    return {**fixed, **placement.settings}


def add_bos(config: ExperimentConfig) -> bool:
    """Whether each prompt starts with the tokenizer's bos token (data.add_bos, unless a chat template renders it)."""
    return config.data is not None and config.data.add_bos and not config.data.chat_template


def pipeline_plan(config: ExperimentConfig, run_dir: pathlib.Path, policy_dir: pathlib.Path,
                  prompts_path: pathlib.Path | None):
    """The RL phase of `config` as deploy.rl.config.Pipeline: what each service, the driver and the trainer are told
    (`prompts_path`: the driver's prompts; None with env, where the episode runner takes the driver's place:
    deploy/runs/agentic.py). Its `evaluate` is left for the caller to set (a run measures the served policy; deploy/cluster/k8s.py renders the rest)."""
    from deploy.experiment.reference import reference_path
    from deploy.experiment.teachers import teacher_services
    from deploy.rl.config import Pipeline, RLConfig, merged, nested

    training, evaluation = config.training, config.evaluation
    reward_overrides, reward_env, function = reward_service(config)
    rollout_overrides = _placement(config, "rollout")
    if config.model.rollout_path and not config.sft.steps:
        rollout_overrides.setdefault("model", config.model.rollout_path)
    # A KL term's frozen reference: the model RL starts from unless the file names one; the trainer computes its
    # logprobs in a forward-only pass (deploy/experiment/reference.py).
    reference = reference_path(config, policy_dir)
    # every process's spans into the run folder (services/tracing.py), unless the file names another folder
    tracing = {**config.tracing.model_dump(mode="json"), "dir": config.tracing.dir or str(run_dir / "traces")}
    stages = {"dir": str(run_dir / "stages")}  # the rollout's and reward's stage reports (services/stage_reports.py)
    return Pipeline(
        run_dir=run_dir, policy_dir=policy_dir, prompts_path=prompts_path, seed=config.seed,
        rl=RLConfig(
            time_budget_s=training.time_budget_s, max_steps=training.max_steps, group_size=training.group_size,
            groups_per_batch=training.groups_per_batch, max_staleness=training.max_staleness,
            temperature=training.temperature, max_tokens=training.max_tokens, lr=training.lr,
            warmup_steps=training.warmup_steps, eval_interval_s=evaluation.every_s,
            algorithm=config.algorithm.model_dump(mode="json"), publish_overlap=training.publish_overlap,
            driver_concurrency=config.concurrency, checkpoint_interval=config.checkpoint.interval,
            buffer_capacity_batches=training.buffer_capacity_batches, metrics_sample_ids=training.metrics_sample_ids,
            rollout_replicas=config.services.rollout.replicas, reward_replicas=config.services.reward.replicas,
            deterministic=config.deterministic,
        ),
        supervise=config.supervise,
        buffer={"server.tracing": tracing, **_placement(config, "buffer")},
        reward={"server.tracing": tracing, "server.stage_reports": stages, **reward_overrides},
        rollout={"server.tracing": tracing, "server.stage_reports": stages, **rollout_overrides},
        reward_env=reward_env,
        teachers=teacher_services(config),
        driver={"reward_function": function, "reward_timeout_s": config.reward.timeout_s,
                **({"teacher_key": config.teacher_key} if config.teachers else {}),
                "add_bos": add_bos(config),
                "trajectory_log": config.trajectory_log.model_dump(), "tracing": tracing},
        trainer=merged({"batch": {"mini_batches": training.mini_batches,  # a micro-batch = a rank's share of a step
                                   "micro_batch_size": training.batch_size // training.mini_batches
                                   // config.services.trainer.world_size,
                                   **({"max_tokens_per_micro_batch": training.max_tokens_per_micro_batch}
                                      if training.max_tokens_per_micro_batch else {})},
                         "checkpoint": {"keep_last": config.checkpoint.keep_last}, "tracing": tracing,
                         "profile": {"dir": str(run_dir / "profiles")},
                         **({"moe": {"routing_replay": training.routing_replay}}
                            if training.routing_replay != "off" else {}),
                         **({"model": {"lora": config.model.lora.model_dump(mode="json")}} if config.model.lora else {}),
                         **({"ref_model_path": reference} if reference else {})},
                        nested(config.services.trainer.settings)),
        eval_interval_steps=evaluation.every_steps,
        evaluate=None,  # type: ignore[arg-type]
        logging=config.logging, params=config.model_dump(mode="json"),
    )


def base_model(config: ExperimentConfig, run_dir: pathlib.Path, resume: bool) -> pathlib.Path:
    """The model folder the run starts from: model.path, or model.tiny built in RUN_DIR/model-init from the seed
    (a resumed run keeps a whole one)."""
    from deploy.record.run_state import whole_model

    if config.model.tiny is None:
        return pathlib.Path(config.model.path)
    folder = run_dir / "model-init"
    if resume and whole_model(folder):
        return folder
    return config.model.tiny.write(folder, config.seed)


def export(config: ExperimentConfig, run_dir: pathlib.Path, policy_dir: pathlib.Path, progress) -> None:
    """The weights the run ended with as a Hugging Face folder in checkpoint.export_dir (if set): the trainer's last
    checkpoint, which a trainer stopped at the end of the budget writes at its last step (trainer/run.py)."""
    import json

    from deploy.rl.pipeline import read_jsonl
    from trainer.checkpoint import STATE_FILE, export_checkpoint_hf, latest_checkpoint

    if not config.checkpoint.export_dir:
        return
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        progress.note("no checkpoint was saved (the trainer took no step): nothing exported")
        return
    lora = config.model.lora
    export_checkpoint_hf(checkpoint, policy_dir, config.checkpoint.export_dir,
                         None if lora is None else (lora.alpha, lora.dropout))
    step = json.loads((checkpoint / STATE_FILE).read_text())["step"]
    last = max((record["step"] for record in read_jsonl(run_dir / "trainer_metrics.jsonl")), default=0)
    behind = "" if step >= last else (f", {last - step} steps before the trainer's last ({last}): it was killed "
                                      "before its final checkpoint")
    progress.note(f"exported the weights of step {step} to {config.checkpoint.export_dir}{behind}")


def finish_run(config: ExperimentConfig, run_dir: pathlib.Path, policy_dir: pathlib.Path, progress, supervisor, rl):
    """Run the RL phase `rl()` (a deploy.rl.pipeline.PipelineResult) under `supervisor`, stop every process it started
    whatever happens, then export the weights the run ended with and write the run's summary (returned).

    A run that could not train is a failed run: its summary (and summary.json) says why in `failure`, with the last
    error line of the process's log, and nothing is exported. That is a process whose restarts ran out (RunFailed,
    raised again once the summary is written) or a trainer that took no optimizer step (returned: the caller exits
    non-zero on a summary with a failure)."""
    from deploy.local.supervisor import RunFailed
    from deploy.record.run_record import failure_reason
    from deploy.rl.pipeline import recorded_result

    failed = None
    try:
        result = rl()
    except RunFailed as exc:
        failed = exc
    finally:
        supervisor.stop()
        progress.close()
    if failed is not None:
        summary = recorded_result(run_dir, supervisor.restarts()).summary(config.seed, run_dir)
        summary.failure = failure_reason(run_dir, f"{failed.name} {failed.problem}, and {failed.why}",
                                         _log_name(run_dir, failed.log_path))
        progress.finish(summary)
        raise failed
    summary = result.summary(config.seed, run_dir)
    if summary.steps:
        export(config, run_dir, policy_dir, progress)
    else:
        summary.failure = failure_reason(run_dir, f"the trainer took no optimizer step in {summary.rl_seconds:.0f}s "
                                         "of RL")
    progress.finish(summary)
    return summary


def _log_name(run_dir: pathlib.Path, log_path: pathlib.Path) -> str:
    """A process's log as a path in the run folder (logs/trainer.log) where it is one."""
    try:
        return str(pathlib.Path(log_path).resolve().relative_to(run_dir.resolve()))
    except ValueError:
        return str(log_path)
