"""Where a run's curves go besides its JSONL files: TensorBoard event files (on by default), Weights & Biases and
MLflow (off by default; each through its own library: `pip install -e '.[loggers]'`).

    logging:
      tensorboard: true                       # RUN_DIR/tensorboard/
      wandb: {project: my-project}            # + entity, name, mode (online | offline | disabled), tags, dir
      mlflow: {experiment: my-experiment}     # + tracking_uri (default: a file store in RUN_DIR/mlruns), run_name

Every logger gets the same scalars (deploy/record/tensorboard.py RunBoard): trainer/... at its optimizer step, and driver/...
(runner/...), eval/..., buffer/..., rollout/..., reward/... at whole seconds of RL. Weights & Biases plots the two
against their own axes (`trainer/step`, `rl_seconds`); MLflow keeps a step per metric. The run's settings (model,
data or env, reward, algorithm, training) are the run's config (W&B) or params (MLflow). The libraries are imported only
when a logger is on.
"""

import os
import pathlib
import time

from deploy.experiment.sections import LoggingSection, MlflowSection, WandbSection

PARAM_SECTIONS = ("seed", "model", "data", "env", "reward", "algorithm", "sft", "training", "evaluation",
                  "checkpoint")


def params(config: dict) -> dict:
    """The settings a run's logger records: the experiment's sections that say what is trained and how (not where
    its services run, nor their TLS files and tokens)."""
    return {name: config[name] for name in PARAM_SECTIONS if name in config}


def flat(settings: dict, prefix: str = "") -> dict[str, str]:
    """{"training": {"lr": 1e-5}} -> {"training.lr": "1e-05"} (MLflow's params are flat strings)."""
    out: dict[str, str] = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:500]
    return out


class WandbWriter:
    """Scalars into a Weights & Biases run."""

    def __init__(self, section: WandbSection, run_dir: pathlib.Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise ImportError("logging.wandb needs the wandb package: pip install -e '.[loggers]'") from None
        folder = pathlib.Path(section.dir) if section.dir else run_dir
        folder.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=section.project, entity=section.entity, name=section.name or run_dir.name,
                              mode=section.mode, tags=section.tags or None, dir=str(folder), config=config,
                              reinit="create_new", settings=wandb.Settings(console="off"))  # the run prints its own
        self.run.define_metric("trainer/step")
        self.run.define_metric("rl_seconds")
        self.axes: set[str] = set()

    def write(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        namespace = next(iter(values)).split("/")[0]
        axis = "trainer/step" if namespace == "trainer" else "rl_seconds"
        if namespace not in self.axes:
            self.axes.add(namespace)
            self.run.define_metric(f"{namespace}/*", step_metric=axis)
        self.run.log({**values, axis: step})

    def close(self) -> None:
        self.run.finish()


class MlflowWriter:
    """Scalars into an MLflow run (through MlflowClient: no process-wide active run)."""

    def __init__(self, section: MlflowSection, run_dir: pathlib.Path, config: dict):
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise ImportError("logging.mlflow needs the mlflow package: pip install -e '.[loggers]'") from None
        uri = section.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if uri is None:  # MLflow 3 keeps its file store for those who opt in: a run folder needs no server
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(section.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None else
                         self.client.create_experiment(section.experiment))
        self.run_id = self.client.create_run(experiment_id, run_name=section.run_name or run_dir.name).info.run_id
        pairs = [Param(key, value) for key, value in flat(config).items()]
        for start in range(0, len(pairs), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=pairs[start:start + 100])
        self.uri = uri

    def write(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        from mlflow.entities import Metric

        stamp = int((wall_time or time.time()) * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, stamp, step) for key, value in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def writers(section: LoggingSection, run_dir: pathlib.Path, config: dict | None = None) -> list:
    """The run's scalar writers, as `section` asks (each with write(values, step, wall_time) and close())."""
    from deploy.record.tensorboard import ScalarWriter

    out: list = []
    if section.tensorboard:
        out.append(ScalarWriter(run_dir / "tensorboard"))
    if section.wandb is not None:
        out.append(WandbWriter(section.wandb, run_dir, params(config or {})))
    if section.mlflow is not None:
        out.append(MlflowWriter(section.mlflow, run_dir, params(config or {})))
    return out
