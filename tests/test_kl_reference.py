"""Issue 41 when the experiment file is read (no run): a KL term's reference is the model RL starts from unless the file
names one; and every setting the trainer would refuse at its start or on its first batch is refused when the file is
loaded (so by `relayrl doctor FILE` and `relayrl sweep`), naming the field and the fix. tests/test_kl_reference_runs.py
runs them (slow)."""

import pathlib

import pytest

from deploy.experiment.quickstart import write_project
from deploy.experiment.schema import load_experiment
from deploy.inspect.doctor import main as doctor
from deploy.rl.plan import pipeline_plan
from services.config import ConfigError


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> pathlib.Path:
    return write_project(tmp_path_factory.mktemp("quickstart") / "project")


def trainer_of(project: pathlib.Path, *overrides: str, start: str = "/runs/r/model-sft") -> dict:
    """What the run's plan tells the trainer (its TrainerConfig fields beyond the addresses and the run folder)."""
    config = load_experiment(project, list(overrides))
    return pipeline_plan(config, pathlib.Path("/runs/r"), pathlib.Path(start), None).trainer


def test_a_kl_term_without_a_reference_trains_against_the_model_rl_starts_from(project):
    assert trainer_of(project, "algorithm.kl_coef=0.04")["ref_model_path"] == "/runs/r/model-sft"
    assert trainer_of(project, "algorithm.kl_reward_coef=0.01")["ref_model_path"] == "/runs/r/model-sft"
    assert "ref_model_path" not in trainer_of(project)  # no KL: no reference loaded
    # Named: resolved from the experiment file's folder, as every path of it.
    named = trainer_of(project, "algorithm.kl_coef=0.04", "reference.path=model")
    assert named["ref_model_path"] == str(project.parent / "model")


@pytest.mark.parametrize(("overrides", "complaint"), [
    (["services.trainer.settings.batch.micro_batchsize=8"],
     "services.trainer.settings.batch.micro_batchsize: Extra inputs are not permitted"),
    (["services.trainer.settings.batch.micro_batch_size=12"],
     "batch.micro_batch_size=12 does not divide the 64 samples per rank and step: unset batch.micro_batch_size"),
    (["services.trainer.settings.parallel.tp=2"],
     "services.trainer.settings.parallel.tp=2: does not divide the trainer's 1 processes"),
    (["services.trainer.settings.parallel.ep=2"],
     "services.trainer.settings.parallel.ep=2: does not divide the trainer's 1 data-parallel ranks"),
    (["services.trainer.settings.publish.backend=nccl", "services.trainer.settings.device=cpu"],
     "services.trainer.settings: publish.backend 'nccl' sends from the trainer's GPU"),
    (["services.trainer.settings.batch.packing=true", "services.trainer.settings.parallel.tp=2",
      "services.trainer.procs_per_node=2"], "batch.packing: not with parallel.tp > 1"),
    (["algorithm.kl_coef=0.04", "services.trainer.settings.ref_model_path=null"],
     ("services.trainer.settings.ref_model_path: null, but algorithm grpo (kl_coef 0.04, kl_reward_coef 0) needs "
      "reference logprobs")),
    (["algorithm.kl_coef=0.04", "reference.path=model", "services.trainer.settings.ref_model_path=model"],
     "reference and services.trainer.settings.ref_model_path both name the reference"),
    (["algorithm.name=distill", "teacher.path=model", "reference.path=model"],
     "reference: distillation measures the student against its teacher"),
])
def test_a_setting_the_trainer_refuses_is_refused_at_load_naming_the_field(project, overrides, complaint):
    """Each of these loaded before, and the trainer refused it once the services were up (at its start, or on its
    first batch: the reference); the run then took no optimizer step."""
    with pytest.raises(ConfigError) as refused:
        load_experiment(project, overrides)
    assert complaint in str(refused.value), refused.value


def test_doctor_refuses_what_the_trainer_would(project, capsys):
    assert doctor(str(project), ["services.trainer.settings.batch.micro_batch_size=12"]) == 1
    out = capsys.readouterr().out
    assert "ERROR config" in out and "services.trainer.settings: batch.micro_batch_size=12 does not divide" in out


def test_doctor_checks_a_named_references_tokenizer_like_a_teachers(project, tmp_path, capsys):
    from user_project import write_model

    other = write_model(tmp_path / "word-model")  # a word-level tokenizer: other ids for other tokens
    assert doctor(str(project), ["algorithm.kl_coef=0.04", f"reference.path={other}"]) == 1
    out = capsys.readouterr().out
    assert "ERROR tokenizer (trainer vs reference): vocabularies differ" in out, out
    assert "give reference.path a model with the policy's tokenizer" in out
    assert doctor(str(project), ["algorithm.kl_coef=0.04", f"reference.path={project.parent / 'model'}"]) == 0
    assert "OK    tokenizer (trainer vs reference): same vocabulary" in capsys.readouterr().out


def test_a_failed_run_is_not_finished_and_its_resume_drops_the_failed_summary(tmp_path):
    """A run that could not train wrote its summary with the reason: `relayrl run --resume` goes on with it (a finished
    run is refused), and the resumed run, going on, no longer shows the failed attempt's summary."""
    import json

    from deploy.record.run_state import SUMMARY_FILE, finished, start_run_dir

    (tmp_path / SUMMARY_FILE).write_text(json.dumps({"steps": 0, "failure": "the trainer took no optimizer step"}))
    assert not finished(tmp_path)
    start_run_dir(tmp_path, {}, seed=0, resume=True)
    assert not (tmp_path / SUMMARY_FILE).exists()
    (tmp_path / SUMMARY_FILE).write_text(json.dumps({"steps": 12, "failure": None}))
    assert finished(tmp_path)
