"""`relayrl run EXPERIMENT.yaml`: a user's model folder, data and reward, trained by the shared RL phase.

    read + map the data (deploy/experiment_data.py) -> optional SFT warm-up on (prompt, answer) pairs (deploy/warmup.py)
    -> (algorithm.name: dpo) the offline run on the data's preference pairs, in this process (deploy/offline_run.py)
    -> the shared RL phase (deploy/pipeline.py: buffer, reward, rollout, driver, trainer, supervised)
       with the held-out metric = mean reward of greedy completions, by the run's reward
    -> the latest checkpoint exported as a Hugging Face folder, a summary table, a plot and metrics JSONL
"""

import asyncio
import logging
import os
import pathlib
import sys

from deploy.experiment import ExperimentConfig, load_experiment
from deploy.experiment_forms import OFFLINE

log = logging.getLogger("relayrl.experiment")
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


def pipeline_plan(config: ExperimentConfig, run_dir: pathlib.Path, policy_dir: pathlib.Path,
                  prompts_path: pathlib.Path):
    """The RL phase of `config` as deploy.pipeline_config.Pipeline: what each service, the driver and the trainer are told.
    Its `evaluate` is left for the caller to set (a run measures the served policy; deploy/k8s.py renders the rest)."""
    from deploy.pipeline_config import Pipeline, RLConfig, merged, nested
    from deploy.teachers import teacher_services

    training, evaluation = config.training, config.evaluation
    reward_overrides, reward_env, function = reward_service(config)
    rollout_overrides = _placement(config, "rollout")
    if config.model.rollout_path and not config.sft.steps:
        rollout_overrides.setdefault("model", config.model.rollout_path)
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
        buffer=_placement(config, "buffer"), reward=reward_overrides, rollout=rollout_overrides, reward_env=reward_env,
        teachers=teacher_services(config),
        driver={"reward_function": function, "reward_timeout_s": config.reward.timeout_s,
                **({"teacher_key": config.teacher_key} if config.teachers else {}),
                "add_bos": config.data.add_bos and not config.data.chat_template,
                "trajectory_log": config.trajectory_log.model_dump()},
        trainer=merged({"batch": {"mini_batches": training.mini_batches,  # a micro-batch = a rank's share of a step
                                   "micro_batch_size": training.batch_size // training.mini_batches
                                   // config.services.trainer.world_size,
                                   **({"max_tokens_per_micro_batch": training.max_tokens_per_micro_batch}
                                      if training.max_tokens_per_micro_batch else {})},
                         "checkpoint": {"keep_last": config.checkpoint.keep_last}},
                        nested(config.services.trainer.settings)),
        eval_interval_steps=evaluation.every_steps,
        evaluate=None,  # type: ignore[arg-type]
        logging=config.logging, params=config.model_dump(mode="json"),
    )


def _sft_samples(rows, tokenizer, add_bos: bool):
    """The warm-up's samples: each row's prompt, as the driver tokenizes it, and its `answer` field."""
    from deploy.experiment_data import prompt_ids
    from deploy.warmup import sft_sample

    return [sft_sample(row.prompt_id, prompt_ids(row, tokenizer, add_bos),
                       [*tokenizer.encode(str(row.metadata["answer"]), add_special_tokens=False),
                        tokenizer.eos_token_id])
            for row in rows]


def base_model(config: ExperimentConfig, run_dir: pathlib.Path, resume: bool) -> pathlib.Path:
    """The model folder the run starts from: model.path, or model.tiny built in RUN_DIR/model-init from the seed
    (a resumed run keeps a whole one)."""
    from deploy.run_state import whole_model

    if config.model.tiny is None:
        return pathlib.Path(config.model.path)
    folder = run_dir / "model-init"
    if resume and whole_model(folder):
        return folder
    return config.model.tiny.write(folder, config.seed)


def warm_up(config: ExperimentConfig, model_dir: pathlib.Path, run_dir: pathlib.Path, tokenizer, train_rows,
            progress, resume: bool) -> pathlib.Path:
    """The policy RL starts from: `model_dir`, or with sft.steps its supervised warm-up on the training rows'
    answers (deploy/warmup.py) in RUN_DIR/model-sft, which a resumed run keeps once whole."""
    from deploy.run_state import whole_model
    from deploy.warmup import supervised_warmup

    sft = config.sft
    if not sft.steps:
        return model_dir
    policy_dir = run_dir / "model-sft"
    if resume and whole_model(policy_dir):
        progress.note(f"resuming: {policy_dir} is whole, so SFT is not run again")
        return policy_dir
    add_bos = config.data.add_bos and not config.data.chat_template
    with progress.phase(f"SFT warm-up: {sft.steps} steps of {sft.batch_size}"):
        supervised_warmup(model_dir, policy_dir, _sft_samples(train_rows, tokenizer, add_bos), sft.steps,
                          sft.batch_size, sft.lr, config.seed)
    return policy_dir


def export(config: ExperimentConfig, run_dir: pathlib.Path, policy_dir: pathlib.Path, progress) -> None:
    """The weights the run ended with as a Hugging Face folder in checkpoint.export_dir (if set): the trainer's last
    checkpoint, which a trainer stopped at the end of the budget writes at its last step (trainer/run.py)."""
    import json

    from deploy.pipeline import read_jsonl
    from trainer.checkpoint import STATE_FILE, export_checkpoint_hf, latest_checkpoint

    if not config.checkpoint.export_dir:
        return
    checkpoint = latest_checkpoint(run_dir / "checkpoints")
    if checkpoint is None:
        progress.note("no checkpoint was saved (the trainer took no step): nothing exported")
        return
    export_checkpoint_hf(checkpoint, policy_dir, config.checkpoint.export_dir)
    step = json.loads((checkpoint / STATE_FILE).read_text())["step"]
    last = max((record["step"] for record in read_jsonl(run_dir / "trainer_metrics.jsonl")), default=0)
    behind = "" if step >= last else (f", {last - step} steps before the trainer's last ({last}): it was killed "
                                      "before its final checkpoint")
    progress.note(f"exported the weights of step {step} to {config.checkpoint.export_dir}{behind}")


def run_experiment(config: ExperimentConfig, console=None, supervisor=None, resume: bool = False, launcher=None):
    """The whole run; returns deploy.run_state.Summary (its accuracy fields hold the held-out mean reward). With
    `resume`, the run in config.run_dir goes on from where it stopped (deploy/run_state.py). `launcher` starts the
    RL phase's processes (deploy.local_launcher.LocalLauncher by default; deploy.ray_launcher.RayLauncher)."""
    import torch
    from transformers import AutoTokenizer

    from deploy import experiment_data
    from deploy.evaluation import mean_reward
    from deploy.pipeline import run_pipeline
    from deploy.progress import Progress
    from deploy.run_security import secure
    from deploy.run_state import start_run_dir
    from deploy.supervisor import Supervisor

    torch.set_num_threads(1)
    if config.deterministic:  # the SFT warm-up runs in this process
        from services.determinism import use_deterministic_torch

        use_deterministic_torch()
    run_dir = pathlib.Path(config.run_dir)
    start_run_dir(run_dir, config.model_dump(mode="json"), config.seed, resume)
    progress = Progress(run_dir, console)

    model_dir = base_model(config, run_dir, resume)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train_rows, eval_rows = experiment_data.split(config.data, tokenizer, config.seed)
    prompts_path = experiment_data.write_prompts(train_rows, run_dir / "prompts.jsonl")
    policy_dir = warm_up(config, model_dir, run_dir, tokenizer, train_rows, progress, resume)
    if config.algorithm.name in OFFLINE:  # trains on the data's pairs in this process: no services
        from deploy.offline_run import train_offline

        return train_offline(config, run_dir, policy_dir, tokenizer, train_rows, eval_rows, progress)

    add_bos = config.data.add_bos and not config.data.chat_template
    eval_prompts = [(experiment_data.prompt_ids(row, tokenizer, add_bos), row.prompt, row.metadata)
                    for row in eval_rows]
    eval_tokens = config.evaluation.max_tokens or config.training.max_tokens
    plan = pipeline_plan(config, run_dir, policy_dir, prompts_path)
    secure(plan, config.services)
    function = plan.driver["reward_function"]
    plan.evaluate = lambda at: asyncio.run(mean_reward(at.rollout, at.reward, eval_prompts, eval_tokens, function,
                                                       config.reward.timeout_s, rollout_client=plan.client("rollout"),
                                                       reward_client=plan.client("reward")))
    supervisor = supervisor or Supervisor(config.supervise)
    try:
        result = run_pipeline(plan, progress, supervisor, launcher)
    finally:
        supervisor.stop()
        progress.close()
    export(config, run_dir, policy_dir, progress)
    summary = result.summary(config.seed, run_dir)
    progress.finish(summary)
    return summary


def main(path: str, overrides: list[str] | None = None, resume: bool = False, ray_address: str | None = None) -> int:
    from deploy.experiment_data import DataError
    from deploy.placement import local_problems, ray_problems
    from deploy.supervisor import RunFailed
    from services.config import ConfigError

    try:
        config = load_experiment(path, overrides or [])
    except (ConfigError, FileNotFoundError) as exc:
        print(f"relayrl run: {exc}", file=sys.stderr)
        return 2
    if ray_address is not None:
        beyond = ray_problems(config.services) + (["algorithm dpo (an offline run, in this process)"]
                                                  if config.algorithm.name in OFFLINE else [])
        if beyond:
            print(f"relayrl run --ray: not yet supported on Ray: {'; '.join(beyond)}", file=sys.stderr)
            return 2
    elif beyond := local_problems(config.services):
        print(f"relayrl run: starts one process per service on this machine; {path} asks for more "
              f"({'; '.join(beyond)}): `relayrl run {path} --ray ADDRESS` places it on a Ray cluster, "
              f"`relayrl deploy k8s {path}` renders it for Kubernetes", file=sys.stderr)
        return 2
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    launcher = None
    try:
        if ray_address is not None:
            try:
                from deploy.ray_launcher import PlacementError, RayLauncher
            except ImportError as exc:
                print(f"relayrl run --ray needs Ray ({exc}): pip install -e '.[ray]'", file=sys.stderr)
                return 2
            try:
                launcher = RayLauncher(ray_address, config.services)
            except PlacementError as exc:
                print(f"relayrl run --ray: {exc}", file=sys.stderr)
                return 2
        run_experiment(config, resume=resume, launcher=launcher)
    except DataError as exc:
        print(f"relayrl run: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"relayrl run failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if launcher is not None:
            launcher.close()
    return 0
