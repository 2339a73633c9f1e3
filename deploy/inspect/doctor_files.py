"""What `relayrl doctor FILE.yaml` makes of a YAML file, told by what the file holds (not by its name).

    an experiment file  a mapping at least half of whose top-level keys are the experiment's fields (a misspelt one is
                        then named among its errors): deploy/inspect/doctor.py checks it
    a sweep file        a mapping with a key only a sweep file has (SweepConfig's required fields: experiment, params,
                        trials), checked as a sweep: the file loads, the experiment it names is checked by the doctor
                        (its findings under it, with the sweep's `set` applied), each field path of `set` and `params`
                        is a field of the experiment (deploy/sweep/config.py: field_problem, with the nearest field),
                        and each parameter's bounds give a valid experiment (Sweep.check)
    the quickstart's    deploy/experiment/quickstart_experiment.yaml: its paths are those of the project `relayrl run`
      experiment file   writes, so it is checked in a scratch copy of that project (as a sweep of `quickstart` is)
    a Kubernetes        every document has apiVersion and kind (what `relayrl deploy k8s` renders): named, not checked
      manifest
    a run's own file    another YAML file in a run's folder (the trainer's or the runner's config): the folder is what
                        the doctor reads after a run
    anything else       said so, with its top-level keys and the shapes the doctor knows

And what makes an example's missing inputs: the `prepare.py` beside its experiment file (`prepared_by`).
"""

import json
import pathlib
import tempfile
from collections.abc import Callable

import yaml

from deploy.experiment.quickstart import SHIPPED as QUICKSTART_FILE
from deploy.experiment.quickstart import write_project
from deploy.experiment.schema import ExperimentConfig
from deploy.inspect.findings import Finding
from deploy.record.run_state import CONFIG_FILE, RL_CLOCK_FILE, SUMMARY_FILE
from deploy.record.service_registry import REGISTRY_FILE
from deploy.sweep.config import QUICKSTART, Sweep, SweepConfig, field_problem
from services.config import ConfigError, load_config

EXPERIMENT_KEYS = frozenset(ExperimentConfig.model_fields)
SWEEP_KEYS = frozenset(name for name, field in SweepConfig.model_fields.items() if field.is_required()) - EXPERIMENT_KEYS
RUN_FILES = (CONFIG_FILE, SUMMARY_FILE, RL_CLOCK_FILE, REGISTRY_FILE)  # one of them beside a file: a run's folder
Check = Callable[[pathlib.Path, list[str]], list[Finding]]  # the doctor's check of an experiment file


def kind_of(path: str | pathlib.Path) -> tuple[str, list]:
    """(experiment, sweep, kubernetes, run file, unknown or not yaml; the file's YAML documents, or for not yaml the
    parser's complaint). A file that cannot be read is an experiment file: its loader says it is not found."""
    path = pathlib.Path(path)
    try:
        documents = [document for document in yaml.safe_load_all(path.read_text()) if document is not None]
    except OSError:
        return "experiment", []
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        return "not yaml", [str(exc)]
    if documents and all(isinstance(d, dict) and {"apiVersion", "kind"} <= d.keys() for d in documents):
        return "kubernetes", documents
    if len(documents) != 1 or not isinstance(documents[0], dict) or not documents[0]:
        return "unknown", documents
    keys = set(documents[0])
    if keys & SWEEP_KEYS:
        return "sweep", documents
    if 2 * len(keys & EXPERIMENT_KEYS) >= len(keys):
        return "experiment", documents
    if any((path.parent / name).is_file() for name in RUN_FILES):
        return "run file", documents
    return "unknown", documents


def not_an_experiment(path: str | pathlib.Path, overrides: list[str], check: Check) -> list[Finding] | None:
    """The doctor's findings on the file at `path` when it is not a plain experiment file (None when it is one):
    a sweep checked as a sweep, the quickstart's file in a scratch project, what any other file is."""
    path = pathlib.Path(path)
    kind, documents = kind_of(path)
    if kind == "experiment":
        return _quickstart(path, overrides, check) if path.resolve() == QUICKSTART_FILE.resolve() else None
    if kind == "sweep":
        return check_sweep(path, overrides, check)
    if kind == "kubernetes":
        return [_manifest(path, documents)]
    if kind == "not yaml":
        return [Finding("error", "file", f"{path} does not read as YAML: {' '.join(documents[0].split())}",
                        "fix the YAML where the parser points (an experiment or sweep file is one YAML mapping)")]
    if kind == "run file":
        folder, keys = _shown(path.parent), list(map(str, documents[0]))
        ran = f" (the experiment as it ran: {folder / CONFIG_FILE})" if (path.parent / CONFIG_FILE).is_file() else ""
        return [Finding("error", "file", f"{path} is not an experiment file but a file a run wrote into its folder "
                        f"(a service's config: {', '.join(keys[:6])}{', ...' if len(keys) > 6 else ''})",
                        f"relayrl doctor {folder} reads the run{ran}")]
    what = (f"its top-level keys ({', '.join(map(str, documents[0]))}) are neither an experiment file's nor a sweep "
            "file's" if len(documents) == 1 and isinstance(documents[0], dict) and documents[0] else
            "it holds no settings" if not documents else f"it holds {len(documents)} YAML documents" if
            len(documents) > 1 else f"its top level is a {type(documents[0]).__name__}, not a mapping of settings")
    return [Finding("error", "file", f"{path} has no shape the doctor knows: {what}",
                    "give the doctor an experiment file (top-level keys such as model, data, reward, algorithm, "
                    "training: deploy/experiment/schema.py), a sweep file (experiment, params, trials: "
                    "deploy/sweep/config.py) or a run's folder")]


def check_sweep(path: pathlib.Path, overrides: list[str], check: Check) -> list[Finding]:
    """The sweep file at `path` checked as `relayrl sweep` would load it (deploy/sweep/config.py), and the experiment
    it names by `check`, its findings under it."""
    try:
        config = load_config(SweepConfig, path, overrides)
    except ConfigError as exc:
        return [Finding("error", "sweep", str(exc), "fix the field named (deploy/sweep/config.py, SweepConfig, "
                        "documents each)")]
    sweep = Sweep(config, path)
    findings = [Finding("ok", "sweep", f"{path} loads as a sweep file: {config.trials} trials over "
                        f"{', '.join(config.params)} ({config.objective} held-out reward, {config.direction})")]
    unknown = {}
    for section in ("set", "params"):
        for key in getattr(config, section):
            if problem := field_problem(key):
                unknown[key] = problem
                findings.append(Finding("error", f"sweep ({section})", f"{key}: {problem}", "name a field of the "
                                        "experiment file (deploy/experiment/schema.py documents each)"))
    with tempfile.TemporaryDirectory() as scratch:
        experiment, made = sweep.experiment_file, ""
        if config.experiment == QUICKSTART and not experiment.is_file():  # the sweep writes it when it starts
            sweep.experiment_file = experiment = write_project(pathlib.Path(scratch) / "quickstart-project")
            made = " (the quickstart's project, which the sweep writes into its sweep_dir: checked in a scratch copy)"
        if not experiment.is_file():
            findings.append(Finding("error", "sweep (experiment)", f"experiment: {config.experiment} names "
                                    f"{experiment}, which does not exist", "point experiment: at an experiment file "
                                    "(relative: to the sweep file's folder), or write `quickstart`"))
            return findings
        findings.append(Finding("ok", "sweep (experiment)", f"{experiment}{made}: the doctor's findings on it, with "
                                "the sweep's `set` applied, follow"))
        fixed = [f"{key}={json.dumps(value)}" for key, value in config.set.items() if key not in unknown]
        found = check(experiment, fixed)
        findings += [Finding(f.level, f"experiment > {f.check}", f.message, f.fix, f.evidence) for f in found]
        if unknown or any(f.level == "error" and f.check == "config" for f in found):
            findings.append(Finding("warn", "sweep (params)", "the parameters' bounds are checked once every field "
                                    "path is a field and the experiment file loads"))
            return findings
        try:
            sweep.check()
        except ConfigError as exc:
            findings.append(Finding("error", "sweep (params)", str(exc), "keep each range within what its field "
                                    "takes (deploy/experiment/schema.py)"))
            return findings
    findings.append(Finding("ok", "sweep (params)", "each parameter's bounds (and choices) give a valid experiment"))
    return findings


def _quickstart(path: pathlib.Path, overrides: list[str], check: Check) -> list[Finding]:
    """The quickstart's shipped file names the model and data of the project `relayrl run` writes beside its copy."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = write_project(pathlib.Path(scratch) / "quickstart-project")
        return [Finding("ok", "quickstart", f"{path} is the quickstart's experiment file: its paths are those of the "
                        "project `relayrl run` (no argument) writes into runs/quickstart-project; checked in a "
                        "scratch copy of that project"), *check(copy, overrides)]


def _manifest(path: pathlib.Path, documents: list[dict]) -> Finding:
    objects = ", ".join(f"{d['kind']} {(d.get('metadata') or {}).get('name', '')}".strip() for d in documents)
    ours = any(((d.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/name") == "relayrl"
               for d in documents)
    return Finding("error", "file", f"{path} is a Kubernetes manifest ({objects}), not an experiment file" +
                   (", rendered by `relayrl deploy k8s` from one" if ours else ""),
                   "check the experiment file it is rendered from (relayrl doctor EXPERIMENT.yaml), then render it "
                   "again (relayrl deploy k8s EXPERIMENT.yaml --out FOLDER); kubectl apply --dry-run=server -f "
                   f"{path} checks the manifest against a cluster")


def prepared_by(experiment: str | pathlib.Path) -> Callable[[str | None], str | None]:
    """What makes a missing input of the experiment file at `experiment`, for the doctor's fix: an example's
    `prepare.py` beside its file writes the example's model and data into that folder (examples/math_word,
    examples/code_task), so a missing path inside the folder is made by running it. None: nothing known makes it."""
    script = pathlib.Path(experiment).resolve().parent / "prepare.py"

    def command(target: str | None) -> str | None:
        if target is None or not script.is_file() or pathlib.Path(target).exists():
            return None
        return f"python {_shown(script)}" if pathlib.Path(target).resolve().is_relative_to(script.parent) else None
    return command


def _shown(path: pathlib.Path) -> pathlib.Path:
    """`path` as a user in this folder types it: relative to it when inside it."""
    path = path.resolve()
    return path.relative_to(pathlib.Path.cwd()) if path.is_relative_to(pathlib.Path.cwd()) else path
