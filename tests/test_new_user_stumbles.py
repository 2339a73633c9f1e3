"""What a new user tripped over bringing their own tiny Qwen2 (a 15-token word-level tokenizer) and their own JSONL
through an experiment file (issue 30, item 6): each stumble, as it happened, fixed."""

import io
import json
import pathlib

import pytest
import yaml
from rich.console import Console
from user_project import write_project, write_qwen2_without_unk

from deploy.experiment.schema import DataSection, load_experiment
from deploy.inspect.doctor import main as doctor

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("project")
    return write_project(folder, folder / "run")


def test_doctor_names_the_default_unk_token_past_the_embedding_and_the_fix_that_keeps_the_model(project, tmp_path,
                                                                                                capsys):
    """transformers 5 loads a word-level tokenizer saved without an unk token as Qwen2Tokenizer, which adds its
    default unk "<|endoftext|>" as id 15 of a model with 15 embedding rows. Doctor said only "16 tokens but 15 rows",
    and offered two fixes that change the model."""
    model = write_qwen2_without_unk(tmp_path / "model")
    assert doctor(str(project), [f"model.path={model}"]) == 1
    out = capsys.readouterr().out
    assert "the tokenizer has 16 tokens but the model's embedding has 15 rows" in out, out
    assert "'<|endoftext|>' (id 15) is Qwen2Tokenizer's default unk_token" in out, out
    assert "tokenizer_config.json names no unk_token" in out, out
    fix = next(line for line in out.splitlines() if "fix:" in line and "unk_token" in line)
    assert '"unk_token": "<pad>"' in fix and "keep the model" in fix and "resize" not in fix, fix

    # The fix as given: one field in tokenizer_config.json; the model's files stay as they were.
    weights = (model / "model.safetensors").read_bytes()
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "unk_token": "<pad>"}))
    assert doctor(str(project), [f"model.path={model}"]) == 0
    assert "vocabulary 15 of 15 embedding rows" in capsys.readouterr().out
    assert (model / "model.safetensors").read_bytes() == weights


def test_doctor_names_the_tokenizer_file_changes_when_the_default_token_was_saved_into_them(project, tmp_path,
                                                                                              capsys):
    """The same folder after `AutoTokenizer.from_pretrained(folder).save_pretrained(folder)`: transformers' default
    "<|endoftext|>" is now in the tokenizer files (tokenizer_config.json names it unk_token, tokenizer.json lists it
    among its added_tokens), past the embedding. The fix said only "use the tokenizer the model was trained with, or
    resize the embeddings"; it names the two files' changes now, and they are the whole fix."""
    from transformers import AutoTokenizer

    model = write_qwen2_without_unk(tmp_path / "model")
    AutoTokenizer.from_pretrained(model).save_pretrained(model)
    assert doctor(str(project), [f"model.path={model}"]) == 1
    out = capsys.readouterr().out
    assert "'<|endoftext|>' (id 15) is Qwen2Tokenizer's default unk_token, saved into the tokenizer files" in out, out
    fix = next(line for line in out.splitlines() if "fix:" in line and "unk_token" in line)
    assert '"unk_token": "<pad>"' in fix and "tokenizer_config.json" in fix, fix
    assert """remove the entry of '<|endoftext|>' (id 15) from "added_tokens" in""" in fix and "tokenizer.json" in fix
    assert "resize" not in fix, fix

    weights = (model / "model.safetensors").read_bytes()
    settings = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**settings, "unk_token": "<pad>"}))
    backend = json.loads((model / "tokenizer.json").read_text())
    backend["added_tokens"] = [token for token in backend["added_tokens"] if token["content"] != "<|endoftext|>"]
    (model / "tokenizer.json").write_text(json.dumps(backend))
    assert doctor(str(project), [f"model.path={model}"]) == 0
    assert "vocabulary 15 of 15 embedding rows" in capsys.readouterr().out
    assert (model / "model.safetensors").read_bytes() == weights


def users_file(project: pathlib.Path, folder: pathlib.Path, drop: list[str], **sections) -> pathlib.Path:
    """The project's experiment file as a user wrote it: without the fields in `drop` ("data.num_eval"), with
    `sections` laid over (paths absolute: the file lives in `folder`)."""
    settings = yaml.safe_load(project.read_text())
    for dotted in drop:
        section, name = dotted.split(".")
        del settings[section][name]
    for name, values in sections.items():
        settings[name] = {**settings[name], **values}
    settings["model"]["path"] = str(project.parent / "model")
    settings["data"]["train"]["path"] = str(project.parent / "data.jsonl")
    settings["reward"]["python_path"] = [str(project.parent)]
    path = folder / "experiment.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def test_an_eval_file_is_evaluated_whole_unless_num_eval_says_fewer(project, tmp_path, capsys):
    """data.num_eval (64) silently capped an eval file: 500 held-out rows became 64 while doctor said "500 rows"."""
    from transformers import AutoTokenizer

    from deploy.experiment.data import split

    rows = (project.parent / "data.jsonl").read_text().splitlines()
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("\n".join(rows[:100]) + "\n")
    path = users_file(project, tmp_path, ["data.num_eval"], data={"eval": {"path": str(eval_file)}})
    config = load_experiment(path)
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    train, held_out = split(config.data, tokenizer, config.seed)
    assert len(held_out) == 100 and len(train) == len(rows)
    assert doctor(str(path)) == 0
    assert "data (eval): 100 rows with every named field; all 100 evaluated" in capsys.readouterr().out

    config = load_experiment(path, ["data.num_eval=10"])  # asked for fewer: the first 10
    assert [row.prompt_id for row in split(config.data, tokenizer, config.seed)[1]] == [
        json.loads(row)["id"] for row in rows[:10]]
    assert doctor(str(path), ["data.num_eval=10"]) == 0
    assert "only the first 10 evaluated (data.num_eval=10; unset it to use all 100)" in capsys.readouterr().out

    no_eval = users_file(project, tmp_path, ["data.num_eval"])  # no eval file: 64 held out of train, said so
    assert len(split(load_experiment(no_eval).data, tokenizer, 0)[1]) == 64
    assert doctor(str(no_eval)) == 0
    assert f"64 held out for evaluation (data.num_eval), {len(rows) - 64} trained on" in capsys.readouterr().out


def test_the_time_budget_alone_ends_rl_unless_max_steps_is_set(project, tmp_path, capsys):
    """training.max_steps (1000) ended a 240 s run after ~55 s: a tiny model makes ~1,085 steps a minute. The budget
    is what a user sets; a step count is now asked for, not assumed."""
    from deploy.rl.config import Addresses, trainer_config
    from deploy.runs.experiment_run import pipeline_plan
    from trainer.config import TrainerConfig

    path = users_file(project, tmp_path, ["training.max_steps"])
    config = load_experiment(path)
    assert load_experiment(ROOT / "examples" / "experiment" / "experiment.yaml").training.max_steps is None
    plan = pipeline_plan(config, pathlib.Path(config.run_dir), pathlib.Path(config.model.path), pathlib.Path("p"))
    trainer = trainer_config(plan, Addresses("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"))
    assert trainer["max_steps"] is None and TrainerConfig.model_validate(trainer).max_steps is None
    assert doctor(str(path)) == 0
    assert "RL ends when its time budget of 60s is spent (training.max_steps unset)" in capsys.readouterr().out
    assert doctor(str(path), ["training.max_steps=1000"]) == 0
    assert "RL ends after 60s or at optimizer step 1000, whichever comes first" in capsys.readouterr().out


def test_a_trainer_without_a_step_limit_trains_until_stopped_then_checkpoints_its_last_step(tiny_model_dir,
                                                                                            tmp_path):
    """What a run's trainer is told now: no step limit; the end of the budget (SIGTERM) stops it, after the step
    under way, with a checkpoint of that step whatever checkpoint.interval says."""
    import threading

    from test_trainer_loop import BATCH, make_samples, records

    from trainer.checkpoint import latest_checkpoint
    from trainer.config import TrainerConfig
    from trainer.dataset import DatasetSource
    from trainer.loop import train
    from trainer.parallel import init_distributed

    stop = threading.Event()

    class StopOnThirdPull(DatasetSource):
        def pull(self, batch_size, trainer_version=None):
            if self.batches == 2:
                stop.set()  # as SIGTERM would, while the loop trains or waits
            return super().pull(batch_size, trainer_version)

    config = TrainerConfig.model_validate({
        "model_path": str(tiny_model_dir), "max_steps": None, "batch": {"global_batch_size": BATCH},
        "metrics_path": str(tmp_path / "metrics.jsonl"),
        "checkpoint": {"dir": str(tmp_path / "checkpoints"), "interval": 1000}})
    state = train(config, init_distributed("cpu"), StopOnThirdPull(make_samples(4 * BATCH)), stop=stop)
    assert state.step in (2, 3) and records(tmp_path / "metrics.jsonl")[-1]["step"] == state.step
    assert latest_checkpoint(tmp_path / "checkpoints").name == f"step_{state.step:08d}"


def test_the_template_shows_every_data_field_add_bos_included():
    """data.add_bos was not in the template: a user read the code to learn that prompts get one BOS."""
    text = (ROOT / "examples" / "experiment" / "experiment.yaml").read_text()
    data = yaml.safe_load(text)["data"]
    listed = set(data) | {line.split(":")[0].strip("# ") for line in text.splitlines() if line.startswith("  # ")}
    assert set(DataSection.model_fields) <= listed, set(DataSection.model_fields) - listed
    assert data["add_bos"] is True
    assert "bos token" in next(line for line in text.splitlines() if line.strip().startswith("add_bos:"))


def test_the_summary_is_titled_by_the_run(tmp_path):
    """Every run's summary was titled "relayrl quickstart: summary"."""
    from deploy.record.progress import Progress
    from deploy.record.run_state import Summary

    out = io.StringIO()
    run_dir = tmp_path / "my-experiment"
    run_dir.mkdir()
    progress = Progress(run_dir, Console(file=out, width=120))
    progress.finish(Summary(seed=0, sft_accuracy=0.3, final_accuracy=0.8, best_accuracy=0.8, steps=10,
                            completions=640, rl_seconds=60.0, curve=[{"elapsed_s": 0.0, "accuracy": 0.3,
                                                                      "reward_mean": None}]))
    assert "relayrl run my-experiment: summary" in out.getvalue() and "quickstart" not in out.getvalue()


def test_a_stopped_trainer_checkpoints_and_exports_the_weights_it_ended_with(tiny_model_dir, tmp_path,
                                                                             service_factory):
    """The export was the latest checkpoint (every checkpoint.interval steps), not the final weights: it scored 0.764
    where the run's last evaluation of its final weights said 0.832. Now the trainer, stopped at the end of the
    budget (SIGTERM), ends its step, publishes, checkpoints and then the export is of that last step."""
    import signal
    import time

    from safetensors.torch import load_file
    from test_trainer_loop import BATCH, make_samples, put, records, start_trainer, trainer_overrides

    from deploy.experiment.schema import ExperimentConfig
    from deploy.rl.plan import export
    from protos import rollout_pb2, rollout_pb2_grpc
    from services.client import connect_sync
    from trainer.checkpoint import hf_state_dict, read_model_state

    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    rollout = service_factory("rollout", {"model": str(tiny_model_dir)})
    put(buffer.address, make_samples(3 * BATCH))
    metrics = tmp_path / "trainer_metrics.jsonl"
    overrides = trainer_overrides(tiny_model_dir, buffer.address, tmp_path, 1000, **{
        "checkpoint.interval": "1000", "metrics_path": str(metrics), "publish.receivers": f"[{rollout.address}]"})
    trainer = start_trainer(overrides, tmp_path / "trainer.log")
    try:
        deadline = time.monotonic() + 180
        while len(records(metrics)) < 3:  # then it waits for a batch that does not come
            assert trainer.poll() is None and time.monotonic() < deadline, (tmp_path / "trainer.log").read_text()
            time.sleep(0.2)
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(60) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        if trainer.poll() is None:
            trainer.kill()
    last = records(metrics)[-1]
    state = json.loads((tmp_path / "checkpoints" / "step_00000003" / "state.json").read_text())
    assert state["step"] == last["step"] == 3
    with connect_sync(rollout.address) as channel:  # what the run's last evaluation measured
        served = rollout_pb2_grpc.RolloutStub(channel).GetWeightVersion(rollout_pb2.GetWeightVersionRequest(),
                                                                        timeout=10).version
    assert served == state["weight_version"] == last["weight_version"]

    run_dir = tmp_path
    config = ExperimentConfig.model_validate({"model": {"path": str(tiny_model_dir)},
                                              "data": {"train": {"path": "train.jsonl"}}, "run_dir": str(run_dir),
                                              "checkpoint": {"export_dir": str(tmp_path / "export")}})
    notes = []
    export(config, run_dir, tiny_model_dir, type("Notes", (), {"note": staticmethod(notes.append)})())
    assert notes == [f"exported the weights of step 3 to {tmp_path / 'export'}"]
    exported = load_file(tmp_path / "export" / "model.safetensors")
    trained = hf_state_dict(read_model_state(tmp_path / "checkpoints" / "step_00000003"), tied_embeddings=False)
    start = load_file(tiny_model_dir / "model.safetensors")
    assert exported.keys() == trained.keys() == start.keys()
    assert all(exported[name].equal(trained[name]) for name in exported)
    assert not all(exported[name].equal(start[name]) for name in exported)
