"""examples/moe/quickstart_moe.yaml without running it (tests/test_families.py runs it): the tiny Qwen3-MoE it builds
has the shape the file states (model.tiny's mixture-of-experts fields reach the model folder), the run replays the
rollout's routes, and `relayrl doctor` passes on it; the MoE fields are refused on a dense arch."""

import json
from pathlib import Path

import pytest

from deploy.experiment.schema import load_experiment
from deploy.experiment.tiny_model import ModelConfig
from deploy.inspect.doctor import main as doctor
from services.config import ConfigError

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "moe" / "quickstart_moe.yaml"


def test_the_example_builds_the_moe_shape_it_states(tmp_path):
    config = load_experiment(EXAMPLE, [f"run_dir={tmp_path / 'run'}"])
    tiny = config.model.tiny
    assert config.training.routing_replay == "rollout" and tiny.arch == "qwen3_moe"
    # transformers 5 saves num_experts as num_local_experts
    written = json.loads((tiny.write(tmp_path / "model", seed=config.seed) / "config.json").read_text())
    assert written["model_type"] == "qwen3_moe"
    assert (written["num_local_experts"], written["num_experts_per_tok"], written["moe_intermediate_size"]) == (
        tiny.num_experts, tiny.num_experts_per_tok, tiny.moe_intermediate_size)


def test_the_defaults_keep_the_kits_moe_shape(tmp_path):
    written = json.loads((ModelConfig(arch="qwen3_moe").write(tmp_path, seed=0) / "config.json").read_text())
    assert (written["num_local_experts"], written["num_experts_per_tok"], written["moe_intermediate_size"]) == (4, 2, 64)


@pytest.mark.parametrize(("override", "named"), [
    ("model.tiny={num_experts: 8}", "arch is 'qwen2'"),
    ("model.tiny={arch: qwen3_moe, num_experts: 2, num_experts_per_tok: 3}", "num_experts_per_tok=3 exceeds"),
])
def test_a_bad_moe_shape_is_refused_naming_it(override, named, tmp_path):
    with pytest.raises(ConfigError, match=named):
        load_experiment(EXAMPLE, [override, f"run_dir={tmp_path}"])


def test_doctor_passes_on_the_example(tmp_path, capsys):
    assert doctor(str(EXAMPLE), [f"run_dir={tmp_path / 'run'}"]) == 0, capsys.readouterr().out
