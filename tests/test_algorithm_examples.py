"""The algorithm examples' files, without running them (tests/test_families.py runs them): the 2-digit addition data
they train on is the quickstart project's split, byte for byte, so the two cannot drift apart; each RL family and the
SFT example is an experiment file that loads, and loads as the families test starts it (from an SFT checkpoint)."""

from pathlib import Path

import pytest

from deploy.experiment.quickstart import write_data
from deploy.experiment.schema import load_experiment

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "algorithms"
EXPERIMENTS = ["sft", "ppo", "grpo", "grpo_kl", "dr_grpo", "dapo", "gspo", "cispo", "sapo", "rloo", "reinforce_pp",
               "reinforce_pp_baseline"]


def test_the_shipped_data_is_the_quickstart_projects_split(tmp_path):
    write_data(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (EXAMPLES / "data" / name).read_bytes() == (tmp_path / name).read_bytes(), (
            f"examples/algorithms/data/{name} differs from deploy.experiment.quickstart.write_data's: write it again")


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_example_is_an_experiment_file_the_families_test_can_start_from_a_checkpoint(name, tmp_path):
    config = load_experiment(EXAMPLES / f"{name}.yaml")
    assert config.model.tiny is not None and config.sft.steps == 550
    assert Path(config.data.train.path) == EXAMPLES / "data" / "train.jsonl"
    assert config.run_dir == str(EXAMPLES.parents[1] / "runs" / name)
    started = load_experiment(EXAMPLES / f"{name}.yaml", [f"model.path={tmp_path}", "model.tiny=null", "sft.steps=0",
                                                          f"run_dir={tmp_path / 'run'}"])
    assert (started.model.path, started.model.tiny, started.sft.steps) == (str(tmp_path), None, 0)
