"""`relayrl doctor FILE.yaml` on whatever YAML file it is given (deploy/inspect/doctor_files.py): a sweep file is
checked as a sweep (its experiment checked under it, each field path a field of the experiment, the nearest named
when it is not), a Kubernetes manifest, a run's own file or a file of no known shape is named as such, and an
example whose `prepare.py` writes its model and data names that command as the fix when they are missing.
tests/test_examples_doctor.py walks the shipped files."""

import pathlib
import shutil

import pytest
import yaml

from deploy.inspect.doctor import diagnose

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SPACE = {"training.lr": {"type": "float", "low": 1.0e-5, "high": 1.0e-3, "log": True},
         "algorithm.kl_coef": {"type": "float", "low": 0.0, "high": 0.1}}


def _errors(findings) -> list[str]:
    return [finding.render() for finding in findings if finding.level == "error"]


def _sweep(folder: pathlib.Path, **fields) -> pathlib.Path:
    """A sweep of examples/algorithms/grpo.yaml (a tiny model built in code, shipped data: quick to check)."""
    path = folder / "sweep.yaml"
    data = {"experiment": str(EXAMPLES / "algorithms" / "grpo.yaml"), "sweep_dir": "sweep", "params": SPACE,
            "trials": 4, **fields}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(("path", "problem"), [
    ("algorithm.kl_coef", None),
    ("services.trainer.settings.optim.weight_decay", None),  # a free-form mapping: any key below it
    ("teachers.math.path", None),  # a mapping of sections: any key, then the section's fields
    ("algoritm.kl_coef", "the experiment file has no field 'algoritm': the nearest field is algorithm.kl_coef"),
    ("training.time_budget", "training has no field 'time_budget': the nearest field is training.time_budget_s"),
    ("teachers.math.pth", "teachers.math has no field 'pth': the nearest field is teachers.math.path"),
    ("training.lr.x", "training.lr is a value (float), not a section with fields"),
    ("groups.name", "groups is a list"),
    ("zzz", "the experiment file has no field 'zzz' (its fields: job, seed,"),
])
def test_a_field_path_is_a_field_of_the_experiment_file_or_its_nearest_is_named(path, problem):
    from deploy.sweep.config import field_problem

    found = field_problem(path)
    assert (found is None) if problem is None else (problem in found), found


def test_a_sweep_file_is_checked_as_a_sweep_with_its_experiment_under_it(tmp_path):
    findings = diagnose(_sweep(tmp_path, set={"training.time_budget_s": 30}))
    assert not _errors(findings)
    checks = [finding.check for finding in findings]
    assert checks[:2] == ["sweep", "sweep (experiment)"] and checks[-1] == "sweep (params)"
    assert {"experiment > config", "experiment > model (tiny)", "experiment > data (train)"} <= set(checks)
    training = next(f for f in findings if f.check == "experiment > training")
    assert "after 30s" in training.message  # the experiment as the trials run it: `set` applied
    assert not any("Extra inputs" in finding.message for finding in findings)


def test_a_misspelt_field_path_of_a_sweep_is_an_error_naming_the_nearest_field(tmp_path):
    params = {**SPACE, "algoritm.kl_coef": SPACE.pop("algorithm.kl_coef")}
    findings = diagnose(_sweep(tmp_path, params=params, set={"training.time_budget": 30}))
    errors = _errors(findings)
    assert len(errors) == 2, "\n".join(errors)
    assert "sweep (params): algoritm.kl_coef: the experiment file has no field 'algoritm': the nearest field is " \
           "algorithm.kl_coef" in errors[1]
    assert "sweep (set): training.time_budget: training has no field 'time_budget': the nearest field is " \
           "training.time_budget_s" in errors[0]
    assert any(f.check == "experiment > config" and f.level == "ok" for f in findings)  # still checked


def test_a_sweep_of_a_missing_experiment_or_a_bad_bound_says_so(tmp_path):
    findings = diagnose(_sweep(tmp_path, experiment="nowhere.yaml"))
    assert [f.check for f in findings if f.level == "error"] == ["sweep (experiment)"]
    assert f"names {tmp_path / 'nowhere.yaml'}, which does not exist" in _errors(findings)[0]
    findings = diagnose(_sweep(tmp_path, params={"training.lr": {"type": "float", "low": 0.0, "high": 1e-3}}))
    assert _errors(findings) == [next(f.render() for f in findings if f.check == "sweep (params)")]
    assert "params.training.lr = 0.0" in _errors(findings)[0]


def test_a_bad_sweep_field_is_a_sweep_error_not_an_experiment_one(tmp_path):
    [finding] = diagnose(_sweep(tmp_path, trials=0))
    assert finding.check == "sweep" and "trials" in finding.message and "SweepConfig" in finding.fix


@pytest.mark.parametrize(("text", "said"), [
    (("apiVersion: v1\nkind: Service\nmetadata: {name: web}\n---\napiVersion: apps/v1\nkind: Deployment\n"
      "metadata: {name: web}\n"), "is a Kubernetes manifest (Service web, Deployment web), not an experiment file"),
    ("name: my-run\nsteps: 3\nlearning_rate: 0.1\n", "its top-level keys (name, steps, learning_rate) are neither"),
    ("- model\n- data\n", "its top level is a list, not a mapping of settings"),
    ("", "it holds no settings"),
    ("model: [unclosed\n", "does not read as YAML"),
])
def test_a_yaml_file_of_another_shape_is_named_not_checked_field_by_field(tmp_path, text, said):
    path = tmp_path / "file.yaml"
    path.write_text(text)
    [finding] = diagnose(path)
    assert finding.level == "error" and finding.check == "file" and said in finding.message, finding.render()


def test_a_service_config_a_run_wrote_points_at_the_run_folder():
    [finding] = diagnose(ROOT / "tests" / "data" / "runs" / "healthy" / "trainer.yaml")
    assert "a file a run wrote into its folder" in finding.message
    assert finding.fix.startswith("relayrl doctor ") and finding.fix.split()[2].endswith("runs/healthy")


def test_a_misspelt_experiment_file_is_still_checked_as_one(tmp_path):
    path = tmp_path / "experiment.yaml"
    path.write_text("model: {tiny: {}}\ndata: {train: {path: train.jsonl}}\nalgoritm: {name: grpo}\n")
    [finding] = diagnose(path)
    assert finding.check == "config" and "algoritm: Extra inputs are not permitted" in finding.message


@pytest.mark.parametrize("name", ["code_task", "math_word"])
def test_an_examples_missing_model_and_data_name_its_prepare_py(tmp_path, monkeypatch, name):
    folder = tmp_path / "examples" / name
    folder.mkdir(parents=True)
    for file in ("experiment.yaml", "prepare.py"):
        shutil.copy(EXAMPLES / name / file, folder)
    monkeypatch.chdir(tmp_path)
    findings = {f.check: f for f in diagnose(folder / "experiment.yaml")}
    for check in ("model (trainer)", "data (train)", "data (eval)"):
        assert findings[check].level == "error"
        assert findings[check].fix == f"make it: python examples/{name}/prepare.py", findings[check].render()
    # Without the prepare.py beside it, or for a path outside its folder, nothing is named that would not make it.
    (folder / "prepare.py").unlink()
    assert "point model.path at" in {f.check: f for f in diagnose(folder / "experiment.yaml")}["model (trainer)"].fix
    shutil.copy(EXAMPLES / name / "prepare.py", folder)
    outside = {f.check: f for f in diagnose(folder / "experiment.yaml", [f"model.path={tmp_path / 'elsewhere'}"])}
    assert "point model.path at" in outside["model (trainer)"].fix
