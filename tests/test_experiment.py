"""A user's own project through `relayrl run EXPERIMENT.yaml` and `relayrl doctor`: a model folder with its own
word-level tokenizer, a JSONL dataset with its own field names, a reward function in a module beside the file."""

import io
import json
import os
import pathlib
import statistics
import subprocess
import sys

import pytest
import yaml
from rich.console import Console
from user_project import write_project

from deploy.experiment.schema import load_experiment
from deploy.inspect.doctor import main as doctor
from deploy.runs.experiment_run import run_experiment
from services.config import ConfigError


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("project")
    return write_project(folder, folder / "run", lr=1e-3, max_steps=100, time_budget_s=120)


def test_settings_are_stated_once_and_paths_resolved(project):
    config = load_experiment(project, ["training.max_staleness=2"])
    assert config.model.path == str(project.parent / "model")
    assert config.reward.python_path == [str(project.parent)]
    assert config.checkpoint.export_dir == str(project.parent / "run" / "export")
    with pytest.raises(ConfigError, match="training.group_size"):
        load_experiment(project, ["training.group_size=1"])
    with pytest.raises(ConfigError, match="reward.function"):
        load_experiment(project, ["reward.function=not a function"])
    with pytest.raises(ConfigError, match=r"checkpoint.interval \(50\) > training.buffer_capacity_batches \(32\)"):
        load_experiment(project, ["checkpoint.interval=50"])  # the buffer would fill with batches held until one
    shipped = load_experiment(pathlib.Path(__file__).parent.parent / "examples" / "experiment" / "experiment.yaml")
    assert shipped.training.max_staleness == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_on_a_users_model_data_and_reward_improves_the_metric(project):
    config = load_experiment(project)
    run_dir = project.parent / "run"
    summary = run_experiment(config, console=Console(file=io.StringIO(), width=120))

    # The settings several services share reached each of them from the one place they are stated.
    driver = yaml.safe_load((run_dir / "driver.yaml").read_text())
    trainer = yaml.safe_load((run_dir / "trainer.yaml").read_text())
    assert driver["max_staleness"] == trainer["max_staleness"] == config.training.max_staleness
    assert driver["group_size"] * driver["groups_per_batch"] == trainer["batch"]["global_batch_size"]
    assert driver["reward_function"] == "experiment"  # the operator function, served under the run's name

    steps = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    assert len(steps) >= 30, f"only {len(steps)} optimizer steps"
    early = statistics.mean(s["reward_mean"] for s in steps[:10])
    late = statistics.mean(s["reward_mean"] for s in steps[-10:])
    assert late > early + 0.15, f"training reward did not rise: first 10 steps {early:.3f}, last 10 {late:.3f}"
    assert summary.final_accuracy > summary.sft_accuracy + 0.2, (
        f"held-out mean reward {summary.sft_accuracy:.3f} -> {summary.final_accuracy:.3f}")
    assert max(s["staleness_max"] for s in steps) <= config.training.max_staleness

    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = run_dir / "export"
    assert AutoTokenizer.from_pretrained(export).get_vocab() == AutoTokenizer.from_pretrained(config.model.path).get_vocab()
    assert AutoModelForCausalLM.from_pretrained(export).config.vocab_size == 27


def test_doctor_passes_a_good_experiment_through_the_command(project):
    root = pathlib.Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "doctor", str(project)], capture_output=True,
                          text=True, env=env, cwd=root, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ERROR" not in done.stdout and "reward: my_reward:first_word imports" in done.stdout


@pytest.mark.parametrize(("override", "named"), [
    ("data.answer_field=answer", "no field 'answer'"),
    ("reward.function=my_reward:missing", "cannot import my_reward:missing"),
    ("reward.function=no_such_module:score", "cannot import no_such_module:score"),
    ("reward.args={color: 1}", "bad function_args"),
    ("data.chat_template=true", "the tokenizer has none"),
    ("training.max_staleness=-1", "training.max_staleness"),
])
def test_doctor_names_the_problem(project, capsys, override, named):
    assert doctor(str(project), [override]) == 1
    out = capsys.readouterr().out
    assert named in out and "ERROR" in out, out


def test_doctor_finds_a_vocabulary_mismatch_between_trainer_and_rollout(project, tiny_model_dir, capsys):
    assert doctor(str(project), [f"model.rollout_path={tiny_model_dir}"]) == 1
    out = capsys.readouterr().out
    assert "vocabularies differ" in out and "embedding rows 27 (trainer) vs" in out, out


def test_doctor_finds_a_tokenizer_larger_than_the_embedding(project, tmp_path, capsys):
    import shutil

    from user_project import word_tokenizer

    model = tmp_path / "model"
    shutil.copytree(project.parent / "model", model)
    tokenizer = word_tokenizer()
    tokenizer.add_tokens(["zebra", "mango"])
    tokenizer.save_pretrained(model)
    assert doctor(str(project), [f"model.path={model}"]) == 1
    assert "the tokenizer has 29 tokens but the model's embedding has 27 rows" in capsys.readouterr().out


def test_doctor_finds_a_taken_port(project, capsys):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert doctor(str(project), [f"services.rollout.port={port}"]) == 1
    assert f"127.0.0.1:{port} is taken" in capsys.readouterr().out


def test_doctor_leaves_the_port_of_a_service_on_a_group_to_its_nodes(project, capsys):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert doctor(str(project), [f"services.rollout.port={port}", "groups=[{name: inference}]",
                                     "services.rollout.group=inference"]) == 0
    assert f"127.0.0.1:{port}" not in capsys.readouterr().out
