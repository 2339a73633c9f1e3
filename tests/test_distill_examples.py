"""The distillation examples' files, without running them (tests/test_distill_e2e.py runs them): distill.yaml,
mopd.yaml and mopd's subtraction teacher grpo_sub.yaml load as experiment files, their shipped data is what
data/make_domains.py writes, and `relayrl doctor` passes on them once the teachers exist, and names the command
that makes a teacher that does not."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.experiment.schema import load_experiment
from deploy.experiment.tasks import arithmetic_tasks
from deploy.inspect.doctor import main as doctor

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "algorithms"
DATA = ["sub_train.jsonl", "sub_eval.jsonl", "domains_train.jsonl", "domains_eval.jsonl"]
TEACHERS = {"distill": ["teacher"], "mopd": ["teachers.add", "teachers.sub"]}


def test_the_examples_load_with_their_teachers_and_where_they_come_from():
    distill = load_experiment(EXAMPLES / "distill.yaml")
    assert distill.algorithm.name == "distill" and distill.model.tiny is not None
    assert distill.teacher.path == str(ROOT / "runs" / "grpo" / "export")
    assert distill.teacher.made_by == "relayrl run examples/algorithms/grpo.yaml"
    mopd = load_experiment(EXAMPLES / "mopd.yaml")
    assert mopd.algorithm.name == "distill" and mopd.teacher is None and "domain" in mopd.data.metadata_fields
    assert {key: (teacher.path, teacher.made_by) for key, teacher in mopd.teachers.items()} == {
        "add": (str(ROOT / "runs" / "grpo" / "export"), "relayrl run examples/algorithms/grpo.yaml"),
        "sub": (str(ROOT / "runs" / "grpo_sub" / "export"), "relayrl run examples/algorithms/grpo_sub.yaml")}
    sub = load_experiment(EXAMPLES / "grpo_sub.yaml")  # makes mopd's teachers.sub
    assert str(Path(sub.run_dir) / "export") == mopd.teachers["sub"].path == sub.checkpoint.export_dir
    rows = [json.loads(line) for line in Path(mopd.data.train.path).read_text().splitlines()]
    assert {row["domain"] for row in rows} == set(mopd.teachers)


def test_the_shipped_domain_data_is_what_make_domains_writes(tmp_path):
    shutil.copy(EXAMPLES / "data" / "make_domains.py", tmp_path)
    subprocess.run([sys.executable, str(tmp_path / "make_domains.py")], check=True, cwd=ROOT,
                   env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    for name in DATA:
        assert (tmp_path / name).read_bytes() == (EXAMPLES / "data" / name).read_bytes(), (
            f"examples/algorithms/data/{name} differs from what make_domains.py writes: run it again")


def _copy(name: str, folder: Path) -> Path:
    """The example copied to folder/examples/algorithms with data beside it (its relative teacher paths then point
    into `folder`, where no runs/ exist): 1-digit additions for distill's train/eval, mopd's shipped domain files."""
    algorithms = folder / "examples" / "algorithms"
    (algorithms / "data").mkdir(parents=True)
    rows = "".join(json.dumps({"prompt_id": t.prompt_id, "prompt": t.prompt, "answer": t.answer}) + "\n"
                   for t in arithmetic_tasks(digits=1))
    for split in ("train", "eval"):
        (algorithms / "data" / f"{split}.jsonl").write_text(rows)
    for data in DATA[2:]:
        shutil.copy(EXAMPLES / "data" / data, algorithms / "data")
    return Path(shutil.copy(EXAMPLES / f"{name}.yaml", algorithms))


@pytest.mark.parametrize("name", sorted(TEACHERS))
def test_the_doctor_passes_with_the_teachers_made_and_names_how_to_make_a_missing_one(name, tmp_path,
                                                                                    tiny_model_dir, capsys):
    example = _copy(name, tmp_path)
    made = [f"{field}.path={tiny_model_dir}" for field in TEACHERS[name]]
    assert doctor(str(example), made) == 0, capsys.readouterr().out
    assert "ERROR" not in capsys.readouterr().out
    assert doctor(str(example), made[1:]) == 1  # the first teacher left at its shipped path: not made here
    out = capsys.readouterr().out
    assert f"{tmp_path / 'runs' / 'grpo' / 'export'} is not a folder" in out
    assert "fix: make it: relayrl run examples/algorithms/grpo.yaml" in out
