"""Every run shipped in examples/ is an experiment file that `relayrl doctor` passes (issue 30: one form of run).

The test walks examples/: each YAML file is an experiment file (or a sweep file, which names one) and each
experiment file must load and come out of the doctor with no error. Most name everything they need (a tiny model
built in code, data shipped beside them, an environment); the rest need what their header says to make first:
a prepare.py writes the model and data of examples/math_word and examples/code_task, and the templates
(examples/experiment, examples/cluster) name the user's own model and data, which the test brings, and the
distillation examples name their teachers, the exports of other examples' runs, for which a tiny model stands in.
"""

import json
import pathlib

import pytest
import yaml
from test_examples_byo import prepare

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
PREPARED = {"math_word", "code_task"}  # their prepare.py writes work/model, work/train.jsonl, work/eval.jsonl
USER_BRINGS = {"experiment/experiment.yaml", "cluster/experiment.yaml"}  # templates: the user's model and data
# Distillation's teachers are other examples' exports (their `made_by`); a tiny model of the same tokenizer stands in.
TEACHERS = {"algorithms/distill.yaml": ["teacher.path"], "algorithms/mopd.yaml": ["teachers.add.path", "teachers.sub.path"]}


def shipped_yaml() -> list[pathlib.Path]:
    return sorted(path for path in EXAMPLES.rglob("*.yaml") if "node_modules" not in path.parts)


def is_sweep(path: pathlib.Path) -> bool:
    data = yaml.safe_load(path.read_text())
    return isinstance(data, dict) and "params" in data and "experiment" in data


EXPERIMENTS = [path for path in shipped_yaml() if not is_sweep(path)]


def test_the_walk_finds_every_kind_of_example():
    """The agentic and algorithm examples are experiment files now: the walk must reach them."""
    folders = {path.relative_to(EXAMPLES).parts[0] for path in EXPERIMENTS}
    assert {"agentic", "algorithms", "experiment", "math_word", "code_task", "cluster"} <= folders
    assert len([p for p in EXPERIMENTS if p.parent.name == "algorithms"]) == 18  # every family (grpo_kl: GRPO with a KL term), SFT, DPO, distillation and its grpo_sub teacher


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_the_doctor_passes_every_shipped_experiment_file(path, tmp_path, tiny_model_dir):
    from deploy.inspect.doctor import diagnose

    relative, overrides = path.relative_to(EXAMPLES), []
    if relative.parts[0] in PREPARED:
        path = prepare(relative.parts[0], tmp_path)
    elif str(relative) in USER_BRINGS:
        train = tmp_path / "train.jsonl"
        train.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(100)))
        overrides = [f"model.path={tiny_model_dir}", f"data.train.path={train}"]
    overrides += [f"{field}={tiny_model_dir}" for field in TEACHERS.get(str(relative), [])]
    findings = diagnose(path, overrides)
    errors = [finding.render() for finding in findings if finding.level == "error"]
    assert not errors, "\n".join(errors)


def test_the_shipped_sweep_names_an_experiment_and_valid_parameters():
    from deploy.sweep.config import load_sweep

    sweeps = [path for path in shipped_yaml() if is_sweep(path)]
    assert sweeps
    for path in sweeps:
        load_sweep(path, check=False)
