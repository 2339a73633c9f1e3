"""Distillation's teachers from an experiment file (deploy/experiment/teachers.py): refused without distill and required by it,
served as extra rollout services whose addresses reach the driver, and checked by the doctor like the model."""

import pathlib

import pytest
from user_project import write_project

from deploy.experiment.schema import load_experiment
from deploy.inspect.doctor import main as doctor
from deploy.rl.config import Addresses, driver_config
from deploy.runs.experiment_run import pipeline_plan
from services.config import ConfigError


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("project")
    return write_project(folder, folder / "run", max_steps=10, time_budget_s=60)


@pytest.mark.parametrize("overrides, named", [
    (["algorithm.name=distill"], "algorithm distill: needs a teacher"),
    (["teacher.path=teacher"], "only on-policy distillation"),
    (["algorithm.name=distill", "teachers.add.path=teacher"], "list it in data.metadata_fields"),
])
def test_teachers_are_refused_where_they_do_not_fit(project, overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_experiment(project, overrides)


def test_each_teacher_is_a_rollout_service_the_driver_is_told_of(project, tmp_path):
    config = load_experiment(project, ["algorithm.name=distill", "teacher.path=teacher", "teachers.sub.path=sub",
                                       "teachers.sub.settings={engine.dtype: float32}", "teacher_key=kind",
                                       "data.metadata_fields=[kind]"])
    assert config.teacher.path == str(project.parent / "teacher")  # relative to the file, like the model
    plan = pipeline_plan(config, tmp_path, tmp_path / "policy", tmp_path / "prompts.jsonl")
    assert plan.teachers == {"": {"model": str(project.parent / "teacher"), "engine.seed": 0},
                             "sub": {"model": str(project.parent / "sub"), "engine.seed": 0, "engine.dtype": "float32"}}
    driver = driver_config(plan, Addresses("b:1", "r:2", "p:3", teachers={"": "t:4", "sub": "t:5"}))
    assert (driver["teacher"], driver["teachers"], driver["teacher_key"]) == ("t:4", {"sub": "t:5"}, "kind")
    assert "teacher" not in driver_config(plan, Addresses("b:1", "r:2", "p:3"))


def test_the_doctor_checks_each_teacher_like_the_model(project, tiny_model_dir, tmp_path, capsys):
    distill = ["algorithm.name=distill"]
    assert doctor(str(project), [*distill, f"teacher.path={project.parent / 'model'}"]) == 0
    assert "OK    tokenizer (trainer vs teacher): same vocabulary" in capsys.readouterr().out
    assert doctor(str(project), [*distill, f"teacher.path={tiny_model_dir}"]) == 1
    assert "ERROR tokenizer (trainer vs teacher): vocabularies differ" in capsys.readouterr().out
    missing = str(pathlib.Path(tmp_path) / "runs" / "grpo" / "export")
    assert doctor(str(project), [*distill, f"teacher.path={missing}",
                                 "teacher.made_by=relayrl run examples/algorithms/grpo.yaml"]) == 1
    assert "fix: make it: relayrl run examples/algorithms/grpo.yaml" in capsys.readouterr().out
