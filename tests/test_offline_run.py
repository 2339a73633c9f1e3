"""DPO from an experiment file (deploy/runs/offline.py): the pair fields refused where they do not fit, pairs made
into the trainer's samples, and a tiny offline run that writes its metrics and its export. The example's learning
curve is tests/test_families.py's."""

import io
import json
import pathlib

import pytest
from rich.console import Console

from deploy.experiment.data import to_prompts
from deploy.experiment.schema import load_experiment
from deploy.inspect.doctor import main as doctor
from deploy.runs.experiment_run import run_experiment
from deploy.runs.offline import pair_samples
from services.config import ConfigError

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "algorithms" / "dpo_sigmoid.yaml"
PAIRS = [{"prompt_id": f"{a}+{b}", "prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
         for a in range(4) for b in range(4)]


def write_pairs(folder: pathlib.Path) -> list[str]:
    """The --set overrides pointing the example at 12 train and 4 eval pairs written in `folder`."""
    for name, rows in (("train.jsonl", PAIRS[:12]), ("eval.jsonl", PAIRS[12:])):
        (folder / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [f"data.train.path={folder / 'train.jsonl'}", f"data.eval.path={folder / 'eval.jsonl'}"]


@pytest.mark.parametrize("overrides, named", [
    (["data.chosen_field=null"], "data.chosen_field: dpo trains on"),
    (["data.answer_field=answer"], "set answer_field: null"),
    (["training.group_size=8"], "a DPO pair is a group of 2"),
    (["training.max_steps=null"], "training.max_steps: required for an offline run"),
    (["training.mini_batches=64"], "must divide groups_per_batch"),
    (["reward.function=pkg.mod:fn"], "no reward scores anything"),
    (["algorithm.name=grpo"], "preference pairs are trained by DPO"),
])
def test_a_dpo_run_of_the_wrong_shape_is_refused(overrides, named):
    with pytest.raises(ConfigError, match=named):
        load_experiment(EXAMPLE, overrides)


def test_the_shipped_dpo_examples_load():
    for loss_type in ("sigmoid", "ipo", "hinge"):
        config = load_experiment(EXAMPLE.with_name(f"dpo_{loss_type}.yaml"))
        assert (config.algorithm.name, config.algorithm.dpo_loss_type) == ("dpo", loss_type)
        assert pathlib.Path(config.data.train.path).is_file() and pathlib.Path(config.data.eval.path).is_file()


def test_pairs_become_a_group_of_two_samples_each(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    config = load_experiment(EXAMPLE, write_pairs(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    rows = to_prompts(PAIRS[:2], config.data, tokenizer, "train")
    samples = pair_samples(rows, tokenizer, add_bos=True)
    assert [(s.sample_id, s.group_id, s.group_size, s.reward) for s in samples[:2]] == [
        ("dpo/0+0/chosen", "dpo/0+0", 2, 1.0), ("dpo/0+0/rejected", "dpo/0+0", 2, 0.0)]
    chosen, rejected = samples[2:]
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("0+1=", add_special_tokens=False)]
    assert chosen.prompt_ids.tolist() == rejected.prompt_ids.tolist() == prompt
    assert chosen.response_ids.tolist() == [*tokenizer.encode("1", add_special_tokens=False), tokenizer.eos_token_id]
    assert rejected.response_ids.tolist() == [*tokenizer.encode("2", add_special_tokens=False), tokenizer.eos_token_id]
    assert chosen.loss_mask.tolist() == [1, 1]


def test_the_doctor_checks_the_pair_fields(tmp_path, capsys):
    overrides = write_pairs(tmp_path)
    assert doctor(str(EXAMPLE), overrides) == 0
    assert doctor(str(EXAMPLE), [*overrides, "data.rejected_field=worse"]) == 1
    assert "rows have no field 'worse'" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_a_tiny_offline_dpo_run_writes_its_metrics_and_export(tmp_path):
    run_dir = tmp_path / "run"
    config = load_experiment(EXAMPLE, [*write_pairs(tmp_path), f"run_dir={run_dir}", "sft.steps=2", "sft.batch_size=4",
                                       "training.groups_per_batch=4", "training.max_steps=3",
                                       "checkpoint.interval=2"])
    console = io.StringIO()
    summary = run_experiment(config, console=Console(file=console, width=200))

    steps = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all("reward_margin" in s and "reward_accuracy" in s for s in steps)
    start, end = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    assert (start["step"], end["step"]) == (0, 3)
    assert start["reward_margin"] == start["reward_accuracy"] == 0.0  # the policy is its reference at the start
    assert end["reward_margin"] != 0.0
    assert (summary.steps, summary.sft_accuracy, summary.final_accuracy) == (3, start["accuracy"], end["accuracy"])
    assert "held-out pairs (4): preference accuracy" in console.getvalue()
    assert (run_dir / "export" / "config.json").is_file() and (run_dir / "summary.json").is_file()
    assert not (run_dir / "buffer").exists()  # no service ran
