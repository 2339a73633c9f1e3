"""The experiment file: a user's model, data and reward, and how to train on them (`relayrl run EXPERIMENT.yaml`).

One typed YAML file, validated when loaded (unknown keys are errors, every field is documented here). Relative
paths in it are taken from the folder of the file. Settings several services share (group size,
max_staleness, versions per batch) are stated once, under `training`, and handed to each service by
deploy/rl/pipeline.py. `relayrl doctor EXPERIMENT.yaml` (deploy/inspect/doctor.py) checks one before a run.

    model:      a Hugging Face folder (config.json, *.safetensors, tokenizer), or a tiny one built in code
    data:       JSONL / Parquet / a `datasets` folder; which fields hold prompt, answer, metadata; chat template
    env:        instead of data: an environment played turn by turn through rollout sessions (agentic episodes)
    reward:     a built-in by name, an operator function by dotted path, a reward model folder, or a served LLM judge
    algorithm:  trainer.config.algorithm.AlgorithmConfig (grpo, ppo, ... and their variants); dpo trains offline on
                the data's preference pairs instead (data.chosen_field / rejected_field; deploy/experiment/forms.py),
                distill learns from served teachers (`teacher`, `teachers`: deploy/experiment/teachers.py)
    reference:  the frozen KL reference when it is not the model RL starts from (deploy/experiment/reference.py)
    training:   the shared RL settings (group size, staleness, learning rate, budget)
    evaluation: held-out mean reward of greedy completions, every so many seconds or steps
    checkpoint: trainer checkpoints and the final export to a Hugging Face folder
    logging:    TensorBoard (on by default), Weights & Biases, MLflow (deploy/record/loggers.py)
    groups:     node groups (hosts or a Kubernetes selector, devices per node); none = everything on this machine
    services:   where each service runs (its group, replicas, resources, TLS/tokens), extra settings of each, and the
                trainer's torchrun shape and weight-sync rendezvous (deploy/experiment/placement.py)
    trajectory_log: how many of the scored groups RUN_DIR/trajectories.jsonl keeps for `relayrl view RUN_DIR`
"""

import pathlib
import re
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator, model_validator

from deploy.experiment.forms import TeacherSection, form_problems
from deploy.experiment.placement import KubernetesSection, NodeGroup, ServicesSection, placement_problems
from deploy.experiment.reference import ReferenceSection, reference_problems
from deploy.experiment.sections import LoggingSection, SuperviseConfig, deterministic_problems
from deploy.experiment.tiny_model import ModelConfig
from deploy.experiment.trainer_fit import trainer_problems
from reward.judge import JudgeConfig
from reward.registry import BUILTINS, DOTTED_PATTERN
from services.config import Strict, TracingConfig, load_config
from trainer.config.algorithm import AlgorithmConfig
from trainer.config.model import LoraConfig

DataFormat = Literal["auto", "jsonl", "parquet", "datasets"]
HELD_OUT_DEFAULT = 64  # rows held out of train without an eval file or data.num_eval


class ModelSection(Strict):
    """The policy: a local Hugging Face folder the trainer trains and the rollout serves (or a tiny one built in code)."""

    path: str | None = Field(None, description="Hugging Face folder: config.json, *.safetensors and the tokenizer "
                             "files. Give `path` or `tiny`.")
    tiny: ModelConfig | None = Field(
        None, description="Instead of `path`: a tiny decoder of this shape with a character tokenizer "
        "(deploy/experiment/tiny_model.py), its weights drawn from `seed`, written to RUN_DIR/model-init: for trying a pipeline "
        "(and the shipped examples) with no download. {} = the default shape.")
    rollout_path: str | None = Field(
        None, description="A different folder for the rollout to serve (e.g. a copy in another dtype); it must hold "
        "the same tokenizer and vocabulary as `path` (relayrl doctor checks). None = `path`.")
    lora: LoraConfig | None = Field(
        None, description="Train LoRA adapters on this model instead of all of it (the trainer's model.lora, "
        "docs/lora.md): {rank, alpha, dropout, target_modules}. The rollout gets the base once, then each version's "
        "adapter alone; the export holds the merged model and the PEFT adapter folder (export_dir/adapter). "
        "None = full fine-tuning.")

    @model_validator(mode="after")
    def _one_source(self) -> "ModelSection":
        if (self.path is None) == (self.tiny is None):
            raise ValueError("give model.path (a Hugging Face folder) or model.tiny (a tiny model built in code): "
                             f"{'both are' if self.path else 'neither is'} set")
        if self.tiny is not None and self.rollout_path is not None:
            raise ValueError("model.rollout_path is a copy of model.path's model: not with model.tiny")
        return self


class DataSource(Strict):
    """One dataset on disk."""

    path: str = Field(description="A .jsonl file (one JSON object per line), a .parquet file, or a folder written "
                      "by `datasets`' save_to_disk.")
    format: DataFormat = Field("auto", description="auto = by the path: .jsonl/.json lines, .parquet, a folder = "
                               "datasets. Parquet and datasets need the [data] extra (pyarrow, datasets).")
    split: str | None = Field(None, description="For a `datasets` folder holding a DatasetDict: the split to read.")


class DataSection(Strict):
    """Prompts (and reference answers) to train and evaluate on."""

    train: DataSource = Field(description="The training prompts.")
    eval: DataSource | None = Field(None, description="Held-out prompts, every row evaluated (unless num_eval says "
                                    "fewer); None = rows held out of train (a seeded shuffle; never trained on).")
    num_eval: int | None = Field(None, gt=0, description="With `eval`: evaluate only its first this many rows (None = "
                                 "all). Without: hold this many rows out of train (None = 64).")
    prompt_field: str = Field("prompt", description="The field holding the prompt text.")
    answer_field: str | None = Field("answer", description="The field holding the reference answer; it reaches the "
                                     "reward as metadata['answer']. None = no answer (a reward model, a judge).")
    id_field: str | None = Field(None, description="The field holding a unique prompt id; None = the row number.")
    metadata_fields: list[str] = Field(default_factory=list, description="More fields handed to the reward as "
                                       "sample metadata (e.g. the tests of a code task).")
    chat_template: bool = Field(False, description="Render each prompt as one user message through the tokenizer's "
                                "chat template (with the generation prompt); the tokenizer must have one.")
    system_prompt: str | None = Field(None, description="With chat_template: a system message before the prompt.")
    add_bos: bool = Field(True, description="Without chat_template: prepend the tokenizer's bos token to each prompt.")
    chosen_field: str | None = Field(None, description="DPO (algorithm.name: dpo): the field holding the preferred "
                                     "response to the prompt; it is the row's answer (an SFT warm-up learns it), so "
                                     "answer_field is null. None = no pairs (an RL run).")
    rejected_field: str | None = Field(None, description="DPO: the field holding the dispreferred response.")
    image_field: str | None = Field(None, description="A vision-language model: the field holding each row's image, a "
                                    "path relative to the data file or base64 bytes; the prompt gets the image "
                                    "placeholder before its text unless it holds one (docs/multimodal.md).")

    def eval_count(self, rows: int) -> int:
        """How many held-out prompts a run evaluates: of an eval file's `rows`, all or the first num_eval; without
        one, num_eval (64 unless set) held out of train's `rows`."""
        if self.eval is not None:
            return rows if self.num_eval is None else min(rows, self.num_eval)
        return self.num_eval or HELD_OUT_DEFAULT


class RewardSection(Strict):
    """How a completion is scored (by the reward service)."""

    function: str = Field("exact_match", description="A built-in (" + ", ".join(sorted(BUILTINS)) + ") or an "
                          "operator function 'package.module:function' (fn(sample, **args) -> float | RewardOutput), "
                          "importable from python_path. Ignored when `model` or `judge` is set.")
    args: dict[str, object] = Field(default_factory=dict, description="Arguments fixed for every call of the "
                                    "function (e.g. {extract: boxed}); an error with `model` or `judge`, which take none.")
    python_path: list[str] = Field(default_factory=lambda: ["."], description="Folders added to the reward "
                                   "service's PYTHONPATH to import an operator function (relative: to this file).")
    model: str | None = Field(None, description="A sequence-classification reward model folder scored as the "
                              "reward instead of `function`.")
    judge: JudgeConfig | None = Field(None, description="An LLM served elsewhere (OpenAI-compatible: vLLM, SGLang, "
                                      "a relayrl rollout) that grades each completion instead of `function`: "
                                      "{url, model, template, mode: logprob | generate, ...} (reward/judge.py).")
    timeout_s: float = Field(10.0, gt=0, description="Per-sample scoring timeout.")

    @field_validator("function")
    @classmethod
    def _known_or_dotted(cls, function: str) -> str:
        if function not in BUILTINS and not re.match(DOTTED_PATTERN, function):
            raise ValueError(f"{function!r} is not a built-in ({', '.join(sorted(BUILTINS))}) nor a "
                             "'package.module:function' path")
        return function

    @model_validator(mode="after")
    def _one_scorer(self) -> "RewardSection":
        if self.model is not None and self.judge is not None:
            raise ValueError("model and judge: give one (a reward model folder, or a served LLM judge)")
        scorer = "model" if self.model is not None else "judge" if self.judge is not None else None
        if scorer and self.args:
            raise ValueError(f"args: {scorer} is set, and a {'reward model' if scorer == 'model' else 'judge'} takes "
                             f"no function args (args go to `function`, which {scorer} replaces): remove args")
        if self.judge is not None and self.judge.timeout_s >= self.timeout_s:
            raise ValueError(f"judge.timeout_s ({self.judge.timeout_s:g}s per request) must be below timeout_s "
                             f"({self.timeout_s:g}s per sample, retries included)")
        return self

    @property
    def custom(self) -> bool:
        """Whether the reward service must be told about this function (a path, a model, a judge, bound args)."""
        return (self.model is not None or self.judge is not None or self.function not in BUILTINS
                or bool(self.args))


class SFTSection(Strict):
    """An optional supervised warm-up before RL: on the train split's (prompt, answer) pairs, or with `env` on
    episodes a scripted player plays (rollout/envs/transcripts.py), the loss on the player's turns."""

    steps: int = Field(0, ge=0, description="Optimizer steps; 0 = no warm-up (RL starts from the model).")
    batch_size: int = Field(32, gt=0)
    lr: float = Field(1e-4, gt=0)
    transcripts: int = Field(4000, gt=0, description="With env: episodes the scripted player plays.")
    skill: float = Field(1.0, ge=0, le=1, description="With env: the chance each player turn is the expert's (else a "
                         "plausible mistake), so a warm-up can leave RL room.")


class EnvSection(Strict):
    """Agentic episodes instead of prompts: an environment (rollout/envs/) played turn by turn through rollout
    sessions by the episode runner. The environment makes its tasks (train and held out) and scores each episode,
    so `data` and `reward` are not given and no reward service runs."""

    name: str = Field(description="A registered environment (rollout/envs/base.py ENVIRONMENTS, e.g. tool_use, "
                      "guess_number).")
    config: dict = Field(default_factory=dict, description="The environment's Config fields (its tasks, turns, "
                         "rewards; rollout/envs/<name>.py).")
    eval_concurrency: int = Field(32, gt=0, description="Greedy held-out episodes in flight.")
    episode_retries: int = Field(30, ge=0, description="Times the episode runner plays an episode again, with a fresh "
                                 "environment, after it failed for an infrastructure reason or its environment "
                                 "raised; a group whose episode runs out of them is dropped alone (rollout/envs/"
                                 "runner.py).")

    @model_validator(mode="after")
    def _known(self) -> "EnvSection":
        from rollout.envs.runner import env_spec

        env_spec(self.name, self.config)  # an unknown name or a bad config field raises ValueError, named
        return self


class TrainingSection(Strict):
    """The RL settings; those shared by several services are stated here once."""

    group_size: int = Field(8, ge=2, description="Completions per prompt (driver, buffer groups, GRPO advantages).")
    groups_per_batch: int = Field(8, ge=1, description="Prompts per trainer batch.")
    max_staleness: int = Field(1, ge=0, description="Weight versions a sample may lag the trainer (buffer, driver, "
                               "trainer); 0 = synchronous on-policy.")
    mini_batches: int = Field(1, ge=1, description="Optimizer steps per batch (trainer batch.mini_batches); each is "
                              "a weight version, so the driver counts this many versions per batch.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    max_steps: int | None = Field(None, gt=0, description="Also stop after this many optimizer steps, if sooner than "
                                  "the budget; None = the time budget alone ends RL.")
    time_budget_s: float = Field(600.0, gt=0, description="Wall-clock budget of the RL phase.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of training completions.")
    max_tokens: int = Field(64, gt=0, description="Longest completion generated (with env: the longest policy "
                            "turn).")
    concurrency: int | None = Field(None, ge=1, description="Prompts (groups) kept in flight; None = 32, or with "
                                    "env (max_staleness + 1) x groups_per_batch, so admission control alone bounds "
                                    "them.")
    max_tokens_per_micro_batch: int | None = Field(
        None, gt=0, description="The trainer's micro-batches by token budget (samples of any length packed up to it); "
        "None = micro-batches of a rank's share of an optimizer step.")
    buffer_capacity_batches: int = Field(32, gt=0, description="Replay buffer capacity in batches.")
    publish_overlap: bool = Field(True, description="Send new weights while the next step computes.")
    metrics_sample_ids: bool = Field(False, description="List each step's sample ids in trainer_metrics.jsonl "
                                     "(audits what was trained, e.g. across restarts and resumes).")
    routing_replay: Literal["off", "rollout"] = Field(
        "off", description="A mixture-of-experts policy: rollout = the trainer runs, for each token, the experts the "
        "rollout engine routed it to (R3, docs/moe.md; the native engine records them, vLLM and SGLang do not); "
        "off = the trainer's routers choose.")

    @property
    def batch_size(self) -> int:
        return self.group_size * self.groups_per_batch

    @model_validator(mode="after")
    def _check(self) -> "TrainingSection":
        if self.batch_size % self.mini_batches:
            raise ValueError(f"mini_batches={self.mini_batches} does not divide the batch of group_size x "
                             f"groups_per_batch = {self.batch_size} samples")
        return self


class EvaluationSection(Strict):
    """The held-out metric: mean reward of greedy completions of the eval prompts, by the run's reward (with env:
    the success rate of greedy episodes of the environment's held-out tasks)."""

    every_s: float = Field(30.0, gt=0, description="Evaluate every this many seconds of RL.")
    every_steps: int | None = Field(None, gt=0, description="Evaluate every this many optimizer steps instead.")
    max_tokens: int | None = Field(None, gt=0, description="Longest greedy completion; None = training.max_tokens.")


class CheckpointSection(Strict):
    """Trainer checkpoints (a restarted trainer resumes from the latest) and the final export."""

    interval: int = Field(10, gt=0, description="Checkpoint every this many optimizer steps.")
    keep_last: int = Field(2, gt=0, description="Checkpoints kept.")
    export_dir: str | None = Field("export", description="At the end, the trained policy as a Hugging Face folder "
                                   "(relative: inside run_dir); None = no export.")


class TrajectoryLogSection(Strict):
    """A sample of the scored groups, kept in RUN_DIR/trajectories.jsonl for `relayrl view RUN_DIR`."""

    every_n_groups: int = Field(10, ge=0, description="Keep every n-th group the driver stores; 0 = no log.")
    max_bytes: int = Field(16 << 20, ge=1 << 12, description="The file's bound: past it the log keeps every other "
                           "group it holds and samples half as often from then on (it covers the whole run).")


class ExperimentConfig(Strict):
    """Everything `relayrl run EXPERIMENT.yaml` needs."""

    job: Literal["experiment"] = Field("experiment", description="Marks an experiment file for `relayrl run`.")
    seed: int = Field(0, description="Seeds the eval split, sampling and training.")
    deterministic: bool = Field(False, description="Two runs of this file train the same steps on the same numbers "
                                "(rewards, losses, gradients): every completion seeded from `seed` and its place in "
                                "the prompt stream, each step's groups generated together with nothing beside them "
                                "(the held-out metric only at the start and the end of RL), batches in one canonical "
                                "order, deterministic torch kernels on fixed threads (services/determinism.py). Needs "
                                "training.max_staleness 0 and one rollout process.")
    run_dir: str = Field("runs/experiment", description="Where the run writes everything (replaced); relative: to "
                         "this file.")
    model: ModelSection
    data: DataSection | None = Field(None, description="The prompts; required unless `env` is set.")
    env: EnvSection | None = Field(None, description="Agentic episodes through sessions instead of `data` "
                                   "(rollout/envs/).")
    reward: RewardSection = Field(default_factory=RewardSection)
    teacher: TeacherSection | None = Field(None, description="On-policy distillation (algorithm.name: distill): the "
                                           "teacher, served beside the student (deploy/experiment/teachers.py).")
    teachers: dict[str, TeacherSection] = Field(default_factory=dict, description="Distillation from a teacher per "
                                                "domain (MOPD): {KEY: teacher}, a prompt's KEY its "
                                                "metadata[teacher_key]; `teacher`, if set, teaches the other domains.")
    teacher_key: str = Field("domain", description="With teachers: the prompt metadata field naming its domain (list "
                             "it in data.metadata_fields).")
    reference: ReferenceSection | None = Field(None, description="The frozen KL reference (algorithm.kl_coef, "
                                               "kl_reward_coef; DPO's): {path: FOLDER}. None = the model RL starts "
                                               "from (after the SFT warm-up), frozen (deploy/experiment/reference.py).")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="What is optimised "
                                       "(trainer.config.algorithm.AlgorithmConfig; docs/algorithms.md).")
    sft: SFTSection = Field(default_factory=SFTSection)
    training: TrainingSection = Field(default_factory=TrainingSection)
    evaluation: EvaluationSection = Field(default_factory=EvaluationSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    logging: LoggingSection = Field(default_factory=LoggingSection, description="Where the curves go besides the "
                                    "JSONL files: TensorBoard (on), Weights & Biases, MLflow (deploy/record/loggers.py).")
    groups: list[NodeGroup] = Field(default_factory=list, description="Node groups services are placed on "
                                    "(deploy/experiment/placement.py); none = every service on this machine.")
    services: ServicesSection = Field(default_factory=ServicesSection)
    kubernetes: KubernetesSection = Field(default_factory=KubernetesSection, description="Image, namespace and "
                                          "project volume for `relayrl deploy k8s` (deploy/cluster/k8s.py).")
    supervise: SuperviseConfig = Field(default_factory=SuperviseConfig, description="Restarts of what dies.")
    trajectory_log: TrajectoryLogSection = Field(default_factory=TrajectoryLogSection, description="What "
                                                 "`relayrl view RUN_DIR` shows (rollout/driver/trajectory_log.py).")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="One trace per sampled group across "
                                   "every service (services/tracing.py, docs/observability.md): its spans go to "
                                   "RUN_DIR/traces unless `dir` says otherwise (`relayrl trace RUN_DIR` shows them); "
                                   "sample_rate 0 = off.")

    @model_validator(mode="after")
    def _placement(self) -> "ExperimentConfig":
        problems = placement_problems(self.groups, self.services)
        trainer, per_step = self.services.trainer, self.training.batch_size // self.training.mini_batches
        if per_step % trainer.world_size:
            problems.append(f"services.trainer: {trainer.nodes} x {trainer.procs_per_node} processes do not split the "
                            f"{per_step} samples of an optimizer step (training.group_size x groups_per_batch / "
                            "mini_batches)")
        if self.deterministic:
            problems += deterministic_problems(self.training.max_staleness, self.services.rollout.replicas)
        problems += self._source_problems() + form_problems(self) + reference_problems(self)
        if not problems:  # what the trainer would refuse of the config the run gives it (once the rest holds)
            problems = trainer_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def _source_problems(self) -> list[str]:
        """What is wrong with where the prompts come from: `data`, or an environment's episodes."""
        if self.env is None:
            if self.data is None:
                return ["data: required (the prompts to train on), unless env names an environment to play"]
            return []
        problems = []
        if self.data is not None:
            problems.append("env and data: give one (the environment makes its own tasks)")
        if self.reward.custom:
            problems.append("reward: the environment scores its episodes; remove the reward section")
        if self.deterministic:
            problems.append("deterministic: not with env (episodes interleave their turns as the rollout answers)")
        if self.services.reward.replicas > 1 or self.services.reward.settings:
            problems.append("services.reward: no reward service runs with env")
        for name in ("buffer", "rollout"):
            if getattr(self.services, name).tls is not None or getattr(self.services, name).auth is not None:
                problems.append(f"services.{name}: TLS and tokens not with env yet (the episode runner and its "
                                "evaluation reach the services in plain text)")
        return problems

    @property
    def concurrency(self) -> int:
        """Prompts (groups of episodes) kept in flight (training.concurrency, or its default)."""
        if self.training.concurrency is not None:
            return self.training.concurrency
        return (self.training.max_staleness + 1) * self.training.groups_per_batch if self.env is not None else 32

    def resolved(self, base: pathlib.Path) -> "ExperimentConfig":
        """A copy with every relative path taken from `base` (the experiment file's folder)."""

        def at(path: str | None, root: pathlib.Path = base) -> str | None:
            return None if path is None else str((root / pathlib.Path(path).expanduser()).resolve())

        data = self.model_copy(deep=True)
        data.run_dir = at(self.run_dir)
        data.model.path = at(self.model.path)
        data.model.rollout_path = at(self.model.rollout_path)
        if data.data is not None:
            data.data.train.path = at(self.data.train.path)
            if data.data.eval is not None:
                data.data.eval.path = at(self.data.eval.path)
        data.reward.python_path = [at(p) for p in self.reward.python_path]
        for teacher in [data.teacher, *data.teachers.values()] if data.teacher else data.teachers.values():
            teacher.path = at(teacher.path)
        if data.reference is not None:
            data.reference.path = at(self.reference.path)
        data.reward.model = at(self.reward.model)
        data.checkpoint.export_dir = at(self.checkpoint.export_dir, pathlib.Path(data.run_dir))
        for name in ("buffer", "reward", "rollout"):  # TLS files, token files
            placement = getattr(data.services, name)
            for section, fields in ((placement.tls, ("cert", "key", "client_ca")), (placement.auth, ("tokens_file",)),
                                    (placement.client, ("ca_cert", "cert", "key", "token_file"))):
                for key in fields if section is not None else ():
                    setattr(section, key, at(getattr(section, key)))
        return data


def load_experiment(path: str | pathlib.Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Load and validate an experiment file (ConfigError names the field), paths resolved from its folder."""
    path = pathlib.Path(path)
    return load_config(ExperimentConfig, path, overrides).resolved(path.resolve().parent)
