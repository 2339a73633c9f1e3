"""The sweep file: a hyper-parameter search over an experiment file (`relayrl sweep SWEEP.yaml`, deploy/sweep/study.py).

One typed YAML file, validated when loaded (unknown keys are errors; every parameter's range is applied to the
experiment and validated there, so a bad path or bound fails before any trial runs). Relative paths in it are
taken from the folder of the file.

    experiment: the base experiment file (deploy/experiment/schema.py), or `quickstart`: the quickstart's project
    set:        fields fixed for every trial (e.g. a shorter training.time_budget_s)
    params:     the search space, by field path: float (log or uniform), int, categorical
    objective:  the held-out mean reward at the end of a trial's RL, or its best; maximize or minimize
    trials, parallel, sampler (Optuna TPE, seeded), pruner (median over the held-out curve), warmup
    sweep_dir:  where the study (study.db), the trials' run folders, results.csv and the plots go

This module applies a trial's parameters to the experiment (`trial_experiment`); it imports neither Optuna nor torch.
"""

import difflib
import json
import pathlib
import types
import typing
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from deploy.experiment.schema import ExperimentConfig
from services.config import ConfigError, Strict, apply_override, load_config

QUICKSTART = "quickstart"
# Field paths a shared warm-up depends on: a parameter among them needs `warmup: per_trial`.
WARMUP_INPUTS = ("seed", "model", "data", "env", "sft")
NOT_SEARCHABLE = ("job", "run_dir")
MAX_CHECKED = 64  # an int parameter's values each checked at load up to this many (its ends beyond)


class FloatParam(Strict):
    """A float drawn from [low, high], uniformly or (log: true) log-uniformly, optionally on a grid of `step`."""

    type: Literal["float"]
    low: float
    high: float
    log: bool = Field(False, description="Log-uniform (low must be > 0), e.g. for learning rates.")
    step: float | None = Field(None, gt=0, description="Grid step (not with log).")

    @model_validator(mode="after")
    def _check(self) -> "FloatParam":
        if self.low > self.high:
            raise ValueError(f"low {self.low:g} is above high {self.high:g}")
        if self.log and self.low <= 0:
            raise ValueError(f"log: low must be > 0 (got {self.low:g})")
        if self.log and self.step is not None:
            raise ValueError("step and log: give one")
        return self

    def bounds(self) -> list[Any]:
        return [self.low, self.high]


class IntParam(Strict):
    """An integer drawn from [low, high] (both included), on a grid of `step`, or log-uniformly."""

    type: Literal["int"]
    low: int
    high: int
    step: int = Field(1, gt=0)
    log: bool = False

    @model_validator(mode="after")
    def _check(self) -> "IntParam":
        if self.low > self.high:
            raise ValueError(f"low {self.low} is above high {self.high}")
        if self.log and (self.low <= 0 or self.step != 1):
            raise ValueError("log: low must be > 0 and step 1")
        return self

    def bounds(self) -> list[Any]:
        """Every value it can take (a grid of up to MAX_CHECKED values), else its ends."""
        values = list(range(self.low, self.high + 1, self.step))
        return values if len(values) <= MAX_CHECKED else [self.low, self.high]


class CategoricalParam(Strict):
    """One of `choices` (None, bool, int, float or str: what Optuna stores)."""

    type: Literal["categorical"]
    choices: list[None | bool | int | float | str] = Field(min_length=1)

    def bounds(self) -> list[Any]:
        return list(self.choices)


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


class SamplerSection(Strict):
    """How Optuna proposes the next trial's parameters."""

    type: Literal["tpe", "random"] = Field("tpe", description="tpe (Optuna's TPESampler) or random.")
    seed: int = Field(0, description="Seeds the sampler: the same sweep proposes the same trials.")
    n_startup_trials: int = Field(3, ge=0, description="TPE: random trials before the model takes over.")


class PrunerSection(Strict):
    """Stopping unpromising trials on their held-out curve (Optuna's MedianPruner): a trial reports each held-out
    evaluation its run writes during RL (metrics.jsonl; Optuna's step 0 is the first after the start of RL, whose
    value is the warm-up's, not the trial's) and is stopped when its best so far is worse than the median of earlier
    trials at the same step."""

    type: Literal["median", "none"] = Field("median", description="median, or none (every trial runs its budget).")
    n_startup_trials: int = Field(2, ge=0, description="Finished trials before any is pruned.")
    n_warmup_steps: int = Field(1, ge=0, description="Evaluations during RL a trial is never pruned on (the first "
                                "n_warmup_steps).")


class SweepConfig(Strict):
    """Everything `relayrl sweep SWEEP.yaml` needs."""

    experiment: str = Field(description="The base experiment file (relative: to this file), or `quickstart`: the "
                            "quickstart's project, written once into SWEEP_DIR/quickstart-project.")
    sweep_dir: str = Field("runs/sweep", description="Where the sweep writes everything (relative: to this file); "
                           "kept: running the sweep again resumes it.")
    set: dict[str, Any] = Field(default_factory=dict, description="Field path -> value fixed for every trial, "
                                "e.g. {training.time_budget_s: 30}.")
    params: dict[str, Param] = Field(min_length=1, description="Field path -> its range: {type: float, low, high, "
                                     "log}, {type: int, low, high, step}, {type: categorical, choices}.")
    objective: Literal["final", "best"] = Field("final", description="A trial's value: the held-out mean reward "
                                                "at the end of its RL (final), or the best of its curve (best).")
    direction: Literal["maximize", "minimize"] = "maximize"
    trials: int = Field(gt=0, description="Trials to finish (completed, pruned or failed; an interrupted one is "
                        "run again and not counted).")
    parallel: int = Field(1, ge=1, description="Trials at once: 1 = one after another; more side by side (each "
                          "trial's services are processes of their own; with --ray, placed on the Ray cluster).")
    sampler: SamplerSection = Field(default_factory=SamplerSection)
    pruner: PrunerSection = Field(default_factory=PrunerSection)
    warmup: Literal["shared", "per_trial"] = Field("shared", description="With sft.steps > 0: shared = one SFT "
                                                   "warm-up in SWEEP_DIR/model-sft that every trial starts RL from; "
                                                   "per_trial = each trial warms up itself (needed when a "
                                                   "parameter changes seed, model, data or sft).")

    @field_validator("params", "set")
    @classmethod
    def _searchable(cls, fields: dict) -> dict:
        for path in fields:
            if path.split(".")[0] in NOT_SEARCHABLE or not all(path.split(".")):
                raise ValueError(f"{path!r}: not a field a trial may change (the sweep sets job and run_dir)")
        return fields

    @model_validator(mode="after")
    def _warmup(self) -> "SweepConfig":
        if self.warmup == "shared":
            touched = [path for path in self.params if path.split(".")[0] in WARMUP_INPUTS]
            if touched:
                raise ValueError(f"params {', '.join(touched)} change the SFT warm-up, which `warmup: shared` runs "
                                 "once for all trials: set `warmup: per_trial`")
        return self



class Sweep:
    """A loaded sweep: its config, its paths resolved, and the base experiment as a mapping (with `set` applied)."""

    def __init__(self, config: SweepConfig, file: pathlib.Path):
        self.config, self.file = config, file.resolve()
        folder = self.file.parent
        self.dir = (folder / pathlib.Path(config.sweep_dir).expanduser()).resolve()
        if config.experiment == QUICKSTART:
            self.experiment_file = self.dir / "quickstart-project" / "experiment.yaml"
        else:
            self.experiment_file = (folder / pathlib.Path(config.experiment).expanduser()).resolve()

    def write_quickstart(self) -> None:
        """With `experiment: quickstart`: the quickstart project (deploy/experiment/quickstart.py), written once."""
        if self.config.experiment == QUICKSTART:
            from deploy.experiment.quickstart import write_project

            write_project(self.experiment_file.parent)

    def base(self) -> dict:
        """The base experiment's mapping with `set` applied."""
        if not self.experiment_file.is_file():
            raise ConfigError(f"experiment: {self.experiment_file} not found")
        data = yaml.safe_load(self.experiment_file.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{self.experiment_file}: the top level must be a mapping")
        for path, value in self.config.set.items():
            apply_override(data, path.split("."), value)
        return data

    def experiment(self, params: dict[str, Any], run_dir: pathlib.Path,
                   warmed: pathlib.Path | None = None) -> ExperimentConfig:
        """The trial's experiment: the base with `set` and `params` applied, running in `run_dir`, and (`warmed`: the
        shared warm-up's model) RL starting from `warmed` with no SFT of its own. ConfigError names the field."""
        return trial_experiment(self.base(), self.experiment_file.parent, params, run_dir, warmed)

    def space(self) -> dict:
        """What a study records of this sweep, to refuse resuming one whose search is another: the parameters'
        ranges, the objective and direction, and the experiment every trial starts from (the base with `set`)."""
        config = self.config
        return json.loads(json.dumps({"params": {k: v.model_dump() for k, v in config.params.items()},
                                      "objective": config.objective, "direction": config.direction,
                                      "experiment": self.base()}, default=str))

    def check(self) -> None:
        """Every field path of `set` and `params` a field of the experiment file (for a path that is no field, the
        nearest that is named), then every parameter's bounds (each choice, each value of a small int range) applied to
        the base experiment and validated, so a search space that can reach a setting the run would refuse (the
        experiment file's checks, what the trainer refuses: deploy/experiment/trainer_fit.py) is refused before any
        trial; ConfigError names the parameter and the field's complaint."""
        problems = [f"{section}.{path}: {problem}" for section in ("set", "params")
                    for path in getattr(self.config, section) if (problem := field_problem(path))]
        if problems:
            raise ConfigError("; ".join(problems))
        run_dir = self.dir / "trial-check"
        services = self.experiment({}, run_dir).services
        fixed = [f"services.{name}.port" for name in ("buffer", "reward", "rollout") if getattr(services, name).port]
        fixed += ["services.trainer.weight_sync.port"] if services.trainer.weight_sync.port else []
        if self.config.parallel > 1 and fixed:
            raise ConfigError(f"parallel: {self.config.parallel} trials side by side would each listen on "
                              f"{', '.join(fixed)}: set them to 0 (any free port) for the sweep")
        for path, param in self.config.params.items():
            for value in param.bounds():
                try:
                    self.experiment({path: value}, run_dir)
                except ConfigError as exc:
                    raise ConfigError(f"params.{path} = {value!r}: {exc}") from None


def field_problem(path: str) -> str | None:
    """None when the dotted `path` names a field of the experiment file (anything under a free-form mapping such as
    reward.args or services.trainer.settings counts); else what is wrong with it, and the nearest field path."""
    parts, fixed, problem = path.split("."), [], None
    annotation: Any = ExperimentConfig
    for part in parts:
        where = ".".join(fixed) or "the experiment file"
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
            annotation = args[0]  # X | None
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            fields = annotation.model_fields
            if part not in fields:
                near = difflib.get_close_matches(part, fields, n=1)
                problem = problem or f"{where} has no field {part!r}"
                if not near:
                    return f"{problem} (its fields: {', '.join(fields)})"
                part = near[0]
            annotation = fields[part].annotation
        elif origin is dict or annotation in (dict, Any, object):  # a mapping of free keys
            annotation = args[1] if len(args) == 2 else Any
            if annotation in (Any, object):  # anything below it is the mapping's own
                fixed.append(part)
                break
        elif origin is list:
            return problem or f"{where} is a list: a sweep sets it whole, not one of its items"
        else:
            return problem or f"{where} is a value ({getattr(annotation, '__name__', annotation)}), not a section with fields"
        fixed.append(part)
    if problem is None:
        return None
    return f"{problem}: the nearest field is {'.'.join(fixed + parts[len(fixed):])}"


def trial_experiment(base: dict, folder: pathlib.Path, params: dict[str, Any], run_dir: pathlib.Path,
                     warmed: pathlib.Path | None = None) -> ExperimentConfig:
    """`base` (an experiment file's mapping, its relative paths from `folder`) with each field path in `params` set
    to its value, `run_dir`, and (`warmed`) model.path = warmed, sft.steps = 0: validated and resolved."""
    data = json.loads(json.dumps(base))  # a deep copy of plain YAML data
    for path, value in params.items():
        apply_override(data, path.split("."), value)
    data["run_dir"] = str(run_dir)
    if warmed is not None:
        apply_override(data, ["model"], {**data.get("model", {}), "path": str(warmed), "tiny": None, "rollout_path": None})
        apply_override(data, ["sft", "steps"], 0)
    try:
        config = ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or '<root>'}: {err['msg']}"
                             for err in exc.errors())
        raise ConfigError(f"invalid experiment: {problems}") from None
    return config.resolved(folder)


def load_sweep(path: str | pathlib.Path, check: bool = True) -> Sweep:
    """Load and validate a sweep file; with `check`, its parameters against the base experiment (ConfigError)."""
    path = pathlib.Path(path)
    sweep = Sweep(load_config(SweepConfig, path), path)
    if check:
        sweep.write_quickstart()
        sweep.check()
    return sweep
