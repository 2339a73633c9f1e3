"""Every YAML file the project ships is one `relayrl doctor` answers as a newcomer needs (issue 30: one form of run;
issue 33: the doctor takes every shipped file).

The test walks the YAML files git tracks. Outside tests/ each is an experiment file or a sweep file, told apart by
what it holds (deploy/inspect/doctor_files.py): each experiment file must load and come out of the doctor with no
error, and each sweep file is checked as a sweep (its experiment under it) with none either. Most experiment files
name everything they need (a tiny model built in code, data shipped beside them, an environment); the quickstart's
file is checked in a scratch copy of the project `relayrl run` writes; the rest need what their header says to make
first: a prepare.py writes the model and data of examples/math_word and examples/code_task (the data and images of
examples/multimodal), and the templates
(examples/experiment, examples/cluster) name the user's own model and data, which the test brings, and the
distillation examples name their teachers, the exports of other examples' runs, for which a tiny model stands in.
Under tests/ the Kubernetes manifests and a run's own files are named as what they are, not checked field by field.
"""

import json
import pathlib
import subprocess

import pytest
from test_examples_byo import prepare

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# Their prepare.py writes work/train.jsonl, work/eval.jsonl and work/model (examples/multimodal: work/images).
PREPARED = {"math_word", "code_task", "multimodal"}
USER_BRINGS = {"experiment/experiment.yaml", "cluster/experiment.yaml"}  # templates: the user's model and data
# Distillation's teachers are other examples' exports (their `made_by`); a tiny model of the same tokenizer stands in.
TEACHERS = {"algorithms/distill.yaml": ["teacher.path"], "algorithms/mopd.yaml": ["teachers.add.path", "teachers.sub.path"]}


def shipped_yaml() -> list[pathlib.Path]:
    tracked = subprocess.run(["git", "ls-files", "*.yaml", "*.yml"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    return [ROOT / name for name in sorted(tracked)]


SHIPPED = [path for path in shipped_yaml() if path.relative_to(ROOT).parts[0] != "tests"]
SWEEPS = [path for path in SHIPPED if path.parent == EXAMPLES / "sweep"]  # the doctor tells them by their keys
EXPERIMENTS = [path for path in SHIPPED if path not in SWEEPS]
OTHERS = [path for path in shipped_yaml() if path.relative_to(ROOT).parts[0] == "tests"]


def _id(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_walk_finds_every_kind_of_example():
    """The agentic and algorithm examples are experiment files now: the walk must reach them, and every shipped
    YAML file outside tests/ is an experiment or a sweep file (the doctor says which: the tests below)."""
    assert SWEEPS and OTHERS
    assert ROOT / "deploy" / "experiment" / "quickstart_experiment.yaml" in EXPERIMENTS
    folders = {path.relative_to(EXAMPLES).parts[0] for path in EXPERIMENTS if path.is_relative_to(EXAMPLES)}
    assert {"agentic", "algorithms", "experiment", "math_word", "code_task", "cluster"} <= folders
    assert len([p for p in EXPERIMENTS if p.parent.name == "algorithms"]) == 18  # every family (grpo_kl: GRPO with a KL term), SFT, DPO, distillation and its grpo_sub teacher


@pytest.mark.parametrize("path", EXPERIMENTS, ids=_id)
def test_the_doctor_passes_every_shipped_experiment_file(path, tmp_path, tiny_model_dir):
    from deploy.inspect.doctor import diagnose

    relative, overrides = path.relative_to(EXAMPLES if path.is_relative_to(EXAMPLES) else ROOT), []
    if relative.parts[0] in PREPARED:
        path = prepare(relative.parts[0], tmp_path, relative.name)
    elif str(relative) in USER_BRINGS:
        train = tmp_path / "train.jsonl"
        train.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(100)))
        overrides = [f"model.path={tiny_model_dir}", f"data.train.path={train}"]
    overrides += [f"{field}={tiny_model_dir}" for field in TEACHERS.get(str(relative), [])]
    findings = diagnose(path, overrides)
    errors = [finding.render() for finding in findings if finding.level == "error"]
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("path", SWEEPS, ids=_id)
def test_the_doctor_checks_every_shipped_sweep_file_as_a_sweep(path):
    from deploy.inspect.doctor import diagnose

    findings = diagnose(path)
    errors = [finding.render() for finding in findings if finding.level == "error"]
    assert not errors, "\n".join(errors)
    checks = {finding.check for finding in findings}
    assert {"sweep", "sweep (experiment)", "experiment > config", "sweep (params)"} <= checks, checks


@pytest.mark.parametrize("path", OTHERS, ids=_id)
def test_the_doctor_names_what_the_other_shipped_yaml_files_are(path):
    from deploy.inspect.doctor import diagnose

    [finding] = diagnose(path)
    assert finding.check == "file" and "Extra inputs" not in finding.message, finding.render()
    said = (["a file a run wrote into its folder"] if path.is_relative_to(ROOT / "tests" / "data" / "runs") else
            ["is a Kubernetes manifest", "rendered by `relayrl deploy k8s`"])
    assert all(words in finding.message for words in said), finding.render()
