"""`relayrl run EXPERIMENT.yaml`: a user's model folder, data and reward, trained by the shared RL phase.

    read + map the data (deploy/experiment/data.py) -> optional SFT warm-up on (prompt, answer) pairs (deploy/experiment/warmup.py)
    -> (algorithm.name: dpo) the offline run on the data's preference pairs, in this process (deploy/runs/offline.py)
    -> the shared RL phase (deploy/rl/pipeline.py: buffer, reward, rollout, driver, trainer, supervised)
       with the held-out metric = mean reward of greedy completions, by the run's reward
    -> the latest checkpoint exported as a Hugging Face folder, a summary table, a plot and metrics JSONL

An experiment with `env` instead of `data` (an environment's episodes through rollout sessions) runs by
deploy/runs/agentic.py.
"""

import asyncio
import base64
import logging
import pathlib
import sys

from deploy.experiment.forms import OFFLINE
from deploy.experiment.schema import ExperimentConfig, load_experiment
from deploy.rl.plan import add_bos, base_model, finish_run, pipeline_plan

log = logging.getLogger("relayrl.experiment")


def _sft_samples(rows, tokenizer, add_bos: bool, model_dir: pathlib.Path | None = None):
    """The warm-up's samples: each row's prompt, as the driver tokenizes it, and its `answer` field; a row's images
    (data.image_field) read as the rollout reads them, with the model folder's image processor: the prompt's image
    runs expanded and the images recorded, so the warm-up sees them."""
    from deploy.experiment.data import prompt_ids
    from deploy.experiment.warmup import sft_sample
    from protos.rollout_pb2 import ImagePart
    from rollout.serve.config import ImageSettings
    from rollout.serve.images import ImageReader

    reader = ImageReader(str(model_dir), ImageSettings()) if any(row.images for row in rows) else None
    samples = []
    for row in rows:
        ids = prompt_ids(row, tokenizer, add_bos)
        read = reader.read([ImagePart(data=base64.b64decode(image)) for image in row.images]) if row.images else []
        sample = sft_sample(row.prompt_id, reader.expand(ids, read) if read else ids,
                            [*tokenizer.encode(str(row.metadata["answer"]), add_special_tokens=False),
                             tokenizer.eos_token_id])
        sample.images = [image.sample_image() for image in read]
        samples.append(sample)
    return samples


def warm_up(config: ExperimentConfig, model_dir: pathlib.Path, run_dir: pathlib.Path, tokenizer, train_rows,
            progress, resume: bool) -> pathlib.Path:
    """The policy RL starts from: `model_dir`, or with sft.steps its supervised warm-up on the training rows'
    answers (deploy/experiment/warmup.py) in RUN_DIR/model-sft, which a resumed run keeps once whole."""
    from deploy.experiment.warmup import supervised_warmup
    from deploy.record.run_state import whole_model

    sft = config.sft
    if not sft.steps:
        return model_dir
    policy_dir = run_dir / "model-sft"
    if resume and whole_model(policy_dir):
        progress.note(f"resuming: {policy_dir} is whole, so SFT is not run again")
        return policy_dir
    with progress.phase(f"SFT warm-up: {sft.steps} steps of {sft.batch_size}"):
        samples = _sft_samples(train_rows, tokenizer, add_bos(config), model_dir)
        supervised_warmup(model_dir, policy_dir, samples, sft.steps,
                          sft.batch_size, sft.lr, config.seed)
    return policy_dir


def run_experiment(config: ExperimentConfig, console=None, supervisor=None, resume: bool = False, launcher=None):
    """The whole run; returns deploy.record.run_state.Summary (its accuracy fields hold the held-out mean reward). With
    `resume`, the run in config.run_dir goes on from where it stopped (deploy/record/run_state.py). `launcher` starts the
    RL phase's processes (deploy.local.launcher.LocalLauncher by default; deploy.cluster.ray_launcher.RayLauncher). An
    experiment with `env` plays an environment's episodes instead (deploy/runs/agentic.py: on this machine, not resumed)."""
    if config.env is not None:
        from deploy.runs.agentic import run_agentic

        return run_agentic(config, console, supervisor)
    import torch
    from transformers import AutoTokenizer

    from deploy.experiment import data as experiment_data
    from deploy.local.security import secure
    from deploy.local.supervisor import Supervisor
    from deploy.record.progress import Progress
    from deploy.record.run_state import start_run_dir
    from deploy.rl.evaluation import mean_reward
    from deploy.rl.pipeline import run_pipeline

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
        from deploy.runs.offline import train_offline

        return train_offline(config, run_dir, policy_dir, tokenizer, train_rows, eval_rows, progress)

    eval_prompts = [(experiment_data.prompt_ids(row, tokenizer, add_bos(config)), row.prompt, row.metadata)
                    for row in eval_rows]
    eval_images = [[base64.b64decode(image) for image in row.images] for row in eval_rows]
    eval_tokens = config.evaluation.max_tokens or config.training.max_tokens
    plan = pipeline_plan(config, run_dir, policy_dir, prompts_path)
    secure(plan, config.services)
    function = plan.driver["reward_function"]
    supervisor = supervisor or Supervisor(config.supervise)
    plan.evaluate = lambda at: asyncio.run(mean_reward(at.rollout, at.reward, eval_prompts, eval_tokens, function,
                                                       config.reward.timeout_s, rollout_client=plan.client("rollout"),
                                                       reward_client=plan.client("reward"), check=supervisor.check,
                                                       images=eval_images if any(eval_images) else None))
    return finish_run(config, run_dir, policy_dir, progress, supervisor,
                      lambda: run_pipeline(plan, progress, supervisor, launcher))


def main(path: str, overrides: list[str] | None = None, resume: bool = False, ray_address: str | None = None) -> int:
    from deploy.experiment.data import DataError
    from deploy.experiment.placement import local_problems, ray_problems
    from deploy.local.supervisor import RunFailed
    from services.config import ConfigError

    try:
        config = load_experiment(path, overrides or [])
    except (ConfigError, FileNotFoundError) as exc:
        print(f"relayrl run: {exc}", file=sys.stderr)
        return 2
    if config.env is not None and (resume or ray_address is not None):
        what = (f"--resume: the run in {config.run_dir} plays" if resume else f"--ray: {path} plays")
        print(f"relayrl run {what} an environment (env: {config.env.name}), which runs on this machine and cannot "
              f"be resumed yet (its episode runner keeps no RL clock): start it over with `relayrl run "
              f"EXPERIMENT.yaml`", file=sys.stderr)
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
                from deploy.cluster.ray_launcher import PlacementError, RayLauncher
            except ImportError as exc:
                print(f"relayrl run --ray needs Ray ({exc}): pip install -e '.[ray]'", file=sys.stderr)
                return 2
            try:
                launcher = RayLauncher(ray_address, config.services)
            except PlacementError as exc:
                print(f"relayrl run --ray: {exc}", file=sys.stderr)
                return 2
        summary = run_experiment(config, resume=resume, launcher=launcher)
    except DataError as exc:
        print(f"relayrl run: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"relayrl run failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if launcher is not None:
            launcher.close()
    if summary.failure:  # it could not train (deploy/rl/plan.py: finish_run): a failed run
        print(f"relayrl run failed: {summary.failure}", file=sys.stderr)
        return 1
    return 0


def run_quickstart(overrides: list[str] | None = None) -> int:
    """`relayrl run` with no file: the quickstart's project written into runs/quickstart-project, then its experiment file run."""
    from deploy.experiment.quickstart import DEFAULT_FOLDER, write_project

    experiment = write_project(DEFAULT_FOLDER.resolve())
    print(f"relayrl run: the quickstart project is in {experiment.parent} (its experiment file: {experiment.name})")
    return main(str(experiment), overrides or [])
