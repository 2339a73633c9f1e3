"""Experiment files with `env` (agentic episodes instead of prompts), without starting a process: the shipped
examples load and pass the doctor, a file that mixes env with data or a reward is refused by name, the run's plan
carries each experiment field to the episode runner and the trainer, and a resume of such a run says it cannot."""

import pathlib

import pytest
import yaml

from deploy.experiment.schema import load_experiment
from deploy.inspect.doctor import main as doctor
from deploy.rl.config import Addresses, buffer_overrides, rollout_overrides
from deploy.runs.agentic import agentic_configs, agentic_plan
from services.config import ConfigError

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples" / "agentic"
ENV = {"name": "guess_number", "config": {"max_number": 7}}


def _write(folder: pathlib.Path, **sections) -> pathlib.Path:
    path = folder / "experiment.yaml"
    path.write_text(yaml.safe_dump({"model": {"tiny": {}}, "env": ENV, **sections}))
    return path


def test_the_shipped_agentic_examples_are_experiment_files_with_env():
    for path in sorted(EXAMPLES.glob("*.yaml")):
        config = load_experiment(path)
        assert config.env.name == path.stem and config.data is None and config.model.tiny is not None
        assert pathlib.Path(config.run_dir).parent == EXAMPLES / "runs"  # relative to the file
        assert config.concurrency == (config.training.max_staleness + 1) * config.training.groups_per_batch
        assert config.training.max_tokens_per_micro_batch == 2048 and config.evaluation.every_s == 60
        assert "job" not in yaml.safe_load(path.read_text())  # `job: experiment` is the default


def test_env_with_data_a_reward_or_tls_is_refused_by_name(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cases = {
        "env and data: give one": {"data": {"train": {"path": "train.jsonl"}}},
        "reward: the environment scores its episodes": {"reward": {"function": "my_pkg.scores:score"}},
        "services.reward: no reward service runs with env": {"services": {"reward": {"replicas": 2}}},
        "services.rollout: TLS and tokens not with env": {"services": {"rollout": {"tls": {"cert": "c", "key": "k"}}}},
        "deterministic: not with env": {"deterministic": True, "training": {"max_staleness": 0}},
    }
    for message, sections in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_experiment(_write(tmp_path, **sections))
    with pytest.raises(ConfigError, match="data: required"):
        load_experiment(_write(tmp_path, env=None))
    with pytest.raises(ConfigError, match="chess"):
        load_experiment(_write(tmp_path, env={"name": "chess"}))
    assert load_experiment(_write(tmp_path)).env.name == "guess_number"


@pytest.mark.parametrize("name", ["guess_number", "tool_use"])
def test_doctor_passes_on_the_shipped_agentic_examples(name, capsys):
    assert doctor(str(EXAMPLES / f"{name}.yaml")) == 0  # the tiny model is built in a temporary folder
    out = capsys.readouterr().out
    env_line = next(line for line in out.splitlines() if line.startswith("OK    env: "))
    assert name in env_line and "policy turns of at most" in env_line
    assert ("20000 train tasks, 100 held out" if name == "tool_use" else "the same 15 tasks") in env_line
    assert "reward:" not in out  # no reward service with env


def test_the_plan_carries_the_experiment_fields_to_the_runner_and_the_trainer(tmp_path):
    config = load_experiment(EXAMPLES / "tool_use.yaml", [
        f"run_dir={tmp_path / 'run'}", "training.group_size=4", "training.groups_per_batch=6", "training.mini_batches=2",
        "training.max_staleness=2", "training.max_tokens=70", "training.temperature=0.8", "training.lr=3e-4",
        "training.warmup_steps=5", "training.max_steps=40", "training.publish_overlap=false",
        "training.buffer_capacity_batches=7", "training.max_tokens_per_micro_batch=1024", "checkpoint.interval=3",
        "checkpoint.keep_last=4", "trajectory_log.every_n_groups=2", "services.rollout.replicas=2",
        "services.rollout.settings={engine.torch_threads: 2}", "services.buffer.settings={fsync: never}",
        "services.trainer.settings={num_threads: 3}", "seed=7", "env.episode_retries=4"])
    run_dir, policy = tmp_path / "run", tmp_path / "model-sft"
    plan = agentic_plan(config, run_dir, policy)
    runner, trainer = agentic_configs(config, plan, Addresses(buffer="b:1", reward="", rollout="router:3"))
    assert runner["rollout"] == "router:3" and runner["buffer"] == "b:1" and runner["env"] == "tool_use"
    assert runner["env_config"]["num_eval"] == 100 and runner["seed"] == 7 and runner["episode_retries"] == 4
    assert (runner["group_size"], runner["groups_per_batch"], runner["max_staleness"]) == (4, 6, 2)
    assert runner["versions_per_batch"] == 2 and runner["max_tokens"] == 70 and runner["temperature"] == 0.8
    assert runner["concurrency"] == (2 + 1) * 6  # training.concurrency unset: admission control alone bounds them
    assert runner["trajectory_log"] == {"path": str(run_dir / "trajectories.jsonl"), "tokenizer": str(policy),
                                        "every_n_groups": 2, "max_bytes": 16 << 20}
    assert runner["stats_path"] == str(run_dir / "runner_stats.jsonl")
    assert trainer["model_path"] == str(policy) and trainer["seed"] == 7 and trainer["max_steps"] == 40
    assert trainer["optim"] == {"lr": 3e-4, "warmup_steps": 5, "max_grad_norm": 1.0}
    assert trainer["batch"] == {"global_batch_size": 24, "micro_batch_size": 12, "mini_batches": 2,
                                "max_tokens_per_micro_batch": 1024}
    assert trainer["checkpoint"] == {"dir": str(run_dir / "checkpoints"), "interval": 3, "keep_last": 4}
    assert trainer["publish"]["receivers_from"] == "router:3" and trainer["publish"]["overlap"] is False
    assert trainer["num_threads"] == 3 and trainer["buffer"]["address"] == "b:1"
    assert trainer["algorithm"]["name"] == "grpo" and trainer["algorithm"]["off_policy"] == "bypass"
    assert buffer_overrides(plan)["capacity"] == 7 * 24 and buffer_overrides(plan)["fsync"] == "never"
    assert rollout_overrides(plan)["engine.torch_threads"] == 2 and plan.rl.rollout_replicas == 2
    # off_policy: bypass only when generation may run ahead and the file does not choose
    on_policy = load_experiment(EXAMPLES / "tool_use.yaml", [f"run_dir={run_dir}", "training.max_staleness=0"])
    chosen = load_experiment(EXAMPLES / "tool_use.yaml", [f"run_dir={run_dir}", "algorithm.off_policy=tis"])
    for other, expected in ((on_policy, "none"), (chosen, "tis")):
        other_plan = agentic_plan(other, run_dir, policy)
        assert agentic_configs(other, other_plan, Addresses("b:1", "", "r:2"))[1]["algorithm"]["off_policy"] == expected


def test_resume_or_ray_of_an_env_run_is_refused_with_a_reason(tmp_path, capsys):
    from deploy.runs.experiment_run import main as run
    from deploy.runs.resume import main as resume

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = load_experiment(EXAMPLES / "guess_number.yaml", [f"run_dir={run_dir}"])
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert resume(str(run_dir)) == 2
    assert "cannot be resumed yet" in capsys.readouterr().err
    assert run(str(EXAMPLES / "guess_number.yaml"), [f"run_dir={run_dir}"], ray_address="127.0.0.1:1") == 2
    assert "runs on this machine" in capsys.readouterr().err
    assert sorted(path.name for path in run_dir.iterdir()) == ["config.yaml"]  # nothing started
