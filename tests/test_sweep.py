"""`relayrl sweep SWEEP.yaml` (deploy/sweep/study.py) without runs: the sweep file's validation, a trial's parameters
applied to the experiment, a stopped study resumed, a trial's points and pruning (a fake run), the results and plots
of a study. tests/test_sweep_quickstart.py runs sweeps of the quickstart (slow)."""

import csv
import json
import pathlib
import shutil
import sys

import pytest
import yaml

from deploy.experiment.quickstart import write_project
from deploy.experiment.schema import load_experiment
from deploy.sweep.config import load_sweep, trial_experiment
from services.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPACE = {
    "training.lr": {"type": "float", "low": 1.0e-5, "high": 1.0e-3, "log": True},
    "algorithm.kl_coef": {"type": "float", "low": 0.0, "high": 0.1},
    "training.groups_per_batch": {"type": "int", "low": 4, "high": 8, "step": 4},
    "training.temperature": {"type": "categorical", "choices": [0.7, 1.0]},
}


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> pathlib.Path:
    """The quickstart's project (its experiment file), written once for the module."""
    return write_project(tmp_path_factory.mktemp("quickstart") / "project")


def _sweep_file(folder: pathlib.Path, experiment: pathlib.Path | str, **fields) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = {"experiment": str(experiment), "sweep_dir": "sweep", "params": SPACE, "trials": 4, **fields}
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_a_trials_parameters_are_set_on_the_experiment_by_field_path(project, tmp_path):
    sweep = load_sweep(_sweep_file(tmp_path, project, set={"training.time_budget_s": 30, "sft.steps": 20}))
    assert sweep.dir == tmp_path / "sweep" and sweep.experiment_file == project
    params = {"training.lr": 3e-4, "algorithm.kl_coef": 0.05, "training.groups_per_batch": 4,
              "training.temperature": 0.7}
    config = sweep.experiment(params, sweep.dir / "trial-3")
    assert (config.training.lr, config.algorithm.kl_coef, config.training.groups_per_batch,
            config.training.temperature) == (3e-4, 0.05, 4, 0.7)
    assert config.training.time_budget_s == 30 and config.sft.steps == 20  # `set`
    assert config.run_dir == str(sweep.dir / "trial-3")
    base = load_experiment(project)
    assert config.model.path == base.model.path and config.data.train.path == base.data.train.path  # resolved
    assert config.training.group_size == base.training.group_size  # the rest as the base file says
    # From a shared warm-up: RL starts from its model, with no SFT of the trial's own.
    warmed = sweep.experiment(params, sweep.dir / "trial-3", warmed=sweep.dir / "model-sft")
    assert warmed.model.path == str(sweep.dir / "model-sft") and warmed.sft.steps == 0
    # The trial's experiment file is an ordinary one: written and loaded back, it is the same experiment.
    written = tmp_path / "trial-3.yaml"
    written.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    assert load_experiment(written) == config


def test_parameters_reach_nested_free_form_sections(project):
    base = yaml.safe_load(project.read_text())
    config = trial_experiment(base, project.parent, {"services.trainer.settings.optim.weight_decay": 0.01},
                              project.parent / "t")
    assert config.services.trainer.settings == {"optim": {"weight_decay": 0.01}}
    assert "optim" not in base.get("services", {}).get("trainer", {}).get("settings", {})  # the base is untouched


@pytest.mark.parametrize(("fields", "complaint"), [
    ({"params": {"training.lrr": {"type": "float", "low": 1e-5, "high": 1e-3}}}, "training.lrr"),
    ({"params": {"algoritm.kl_coef": {"type": "float", "low": 0.0, "high": 0.1}}},
     "params.algoritm.kl_coef: the experiment file has no field 'algoritm': the nearest field is algorithm.kl_coef"),
    ({"set": {"training.time_budget": 30}},
     "set.training.time_budget: training has no field 'time_budget': the nearest field is training.time_budget_s"),
    ({"params": {"training.lr": {"type": "float", "low": 0.0, "high": 1e-3}}}, "greater than 0"),
    ({"params": {"training.lr": {"type": "float", "low": 0.0, "high": 1e-3, "log": True}}}, "log: low must be > 0"),
    ({"params": {"training.lr": {"type": "float", "low": 1e-3, "high": 1e-5}}}, "above high"),
    ({"params": {"training.group_size": {"type": "int", "low": 1, "high": 8}}}, "group_size"),
    ({"params": {"algorithm.name": {"type": "categorical", "choices": ["grpo", "reinforce"]}}}, "reinforce"),
    ({"params": {"training.lr": {"type": "uniform", "low": 1e-5, "high": 1e-3}}}, "does not match any"),
    ({"params": {"training.lr": {"type": "float", "low": 1e-5}}}, "high"),
    ({"params": {}}, "at least 1"),
    ({"params": {"run_dir": {"type": "categorical", "choices": ["a"]}}}, "run_dir"),
    ({"params": {"sft.steps": {"type": "int", "low": 10, "high": 50}}}, "warmup: per_trial"),
    ({"params": {"seed": {"type": "int", "low": 0, "high": 3}}}, "warmup: per_trial"),
    ({"objective": "last"}, "objective"),
    ({"trials": 0}, "trials"),
    ({"pruner": {"type": "hyperband"}}, "pruner.type"),
    ({"budget": 3}, "budget"),
    ({"set": {"training.time_budget_s": -1}}, "time_budget_s"),
    ({"parallel": 2, "set": {"services.reward.port": 50123}}, "services.reward.port"),
    # A space that reaches a setting the trainer refuses (issue 41): refused before any trial, the parameter named.
    ({"params": {"services.trainer.settings.batch.micro_batch_size": {"type": "categorical", "choices": [8, 12]}}},
     "params.services.trainer.settings.batch.micro_batch_size = 12: invalid experiment"),
    ({"params": {"training.mini_batches": {"type": "int", "low": 1, "high": 4}}}, "params.training.mini_batches = 3"),
    ({"set": {"algorithm.kl_coef": 0.04}, "params": {"services.trainer.settings.ref_model_path": {
        "type": "categorical", "choices": ["model", None]}}}, "needs reference logprobs"),
])
def test_a_bad_sweep_file_is_refused_naming_the_field(project, tmp_path, fields, complaint):
    with pytest.raises(ConfigError, match=complaint.replace(".", r"\.").replace("(", r"\(")):
        load_sweep(_sweep_file(tmp_path, project, **fields))


def test_a_missing_experiment_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_sweep(_sweep_file(tmp_path, tmp_path / "nowhere.yaml"))


def test_per_trial_warmup_may_search_the_warmup(project, tmp_path):
    sweep = load_sweep(_sweep_file(tmp_path, project, warmup="per_trial",
                                   params={"sft.steps": {"type": "int", "low": 10, "high": 50}}))
    assert sweep.experiment({"sft.steps": 30}, tmp_path / "t").sft.steps == 30


def test_the_shipped_example_sweeps_the_quickstart(tmp_path):
    """examples/sweep/quickstart_sweep.yaml validates, its quickstart project written into its sweep folder."""
    example = tmp_path / "examples" / "sweep" / "quickstart_sweep.yaml"
    example.parent.mkdir(parents=True)
    shutil.copyfile(ROOT / "examples" / "sweep" / "quickstart_sweep.yaml", example)
    sweep = load_sweep(example)
    assert sweep.dir == tmp_path / "runs" / "quickstart-sweep"
    assert sweep.experiment_file == sweep.dir / "quickstart-project" / "experiment.yaml"
    assert sweep.experiment_file.is_file() and set(sweep.config.params) >= {"training.lr"}


def test_the_results_table_and_plots_of_a_study(tmp_path):
    """A study of five trials whose runs wrote what runs write (summary.json, metrics.jsonl): results.csv names each
    trial's state, value, parameters and figures, the best trial is named, and the plots are written."""
    optuna = pytest.importorskip("optuna")
    from rich.console import Console

    from deploy.sweep.report import report

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=0))
    space = {"training.lr": optuna.distributions.FloatDistribution(1e-5, 1e-3, log=True),
             "training.temperature": optuna.distributions.CategoricalDistribution([0.7, 1.0])}
    for number, final in enumerate([0.3, 0.5, 0.4, None, 0.1]):
        trial = study.ask(space)
        run = tmp_path / f"trial-{number}"
        run.mkdir()
        curve = [{"elapsed_s": 10.0 * i, "accuracy": a, "step": 5 * i} for i, a in enumerate([0.2, 0.25, 0.3])]
        (run / "metrics.jsonl").write_text("".join(json.dumps(p) + "\n" for p in curve) + '{"elapsed')
        for i, point in enumerate(curve):
            trial.report(point["accuracy"], i)
        if number == 3:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            continue
        (run / "summary.json").write_text(json.dumps({"final_accuracy": final, "best_accuracy": 0.6, "steps": 40,
                                                      "rl_seconds": 30.0, "curve": curve + [{"accuracy": final,
                                                                                               "elapsed_s": 30.0}]}))
        study.tell(trial, final)
    console = Console(record=True, width=200)
    best = report(study, tmp_path, "final", console)
    assert best["trial"] == 1 and best["final"] == 0.5 and best["best"] == 0.6
    rows = list(csv.DictReader((tmp_path / "results.csv").read_text().splitlines()))
    assert [(r["trial"], r["state"]) for r in rows] == [("0", "complete"), ("1", "complete"), ("2", "complete"),
                                                        ("3", "pruned"), ("4", "complete")]
    assert float(rows[1]["training.lr"]) == study.trials[1].params["training.lr"]
    assert rows[3]["evaluations"] == "3" and rows[3]["final"] == "0.3" and rows[3]["steps"] == "10"  # a cut curve
    text = console.export_text()
    assert "best trial: trial-1" in text and str(tmp_path / "trial-1") in text
    for name in ("optimization_history", "intermediate_values", "param_importances"):
        assert (tmp_path / "plots" / f"{name}.html").stat().st_size > 1000
        assert (tmp_path / "plots" / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_a_stopped_sweeps_trials_are_kept_completed_or_run_again(project, tmp_path):
    """What the next start of a sweep finds in its study.db: finished trials kept; a trial left running whose run
    finished is completed from its summary; one whose run did not is failed and its parameters queued again; the
    count goes on to `trials`; a study of another search is refused; so is a second sweep in the same folder."""
    optuna = pytest.importorskip("optuna")
    from rich.console import Console

    from deploy.sweep.study import STUDY_FILE, SweepError, counted, distributions, open_study, sweep_lock

    sweep = load_sweep(_sweep_file(tmp_path, project))
    sweep.dir.mkdir()
    console = Console(record=True, width=200)
    with pytest.raises(SweepError, match="no study"):
        open_study(sweep, resume=True, console=console)
    study = open_study(sweep, resume=False, console=console)
    space = distributions(sweep)
    done, _run_finished, cut_short = study.ask(space), study.ask(space), study.ask(space)
    study.tell(done, 0.4)
    (sweep.dir / "trial-1").mkdir()
    (sweep.dir / "trial-1" / "summary.json").write_text(json.dumps({"final_accuracy": 0.5, "best_accuracy": 0.6}))
    # the sweep was killed here: trials 1 and 2 are left running in the study

    study = open_study(sweep, resume=True, console=console)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "FAIL", "WAITING"]
    assert trials[1].value == 0.5
    assert trials[3].user_attrs == {"rerun_of": 2} and counted(study) == 2
    rerun = study.ask(space)
    assert rerun.number == 3 and rerun.params == cut_short.params
    assert "trial-2: interrupted" in console.export_text()
    # The trial that failed on its own counts; the interrupted one does not.
    rerun.set_user_attr("failed", "relayrl run exited 1")
    study.tell(rerun, state=optuna.trial.TrialState.FAIL)
    assert counted(study) == 3

    changed = load_sweep(_sweep_file(tmp_path, project, objective="best"))
    with pytest.raises(SweepError, match="another search"):
        open_study(changed, resume=False, console=console)
    changed = load_sweep(_sweep_file(tmp_path, project, set={"training.time_budget_s": 99}))
    with pytest.raises(SweepError, match="another search"):
        open_study(changed, resume=False, console=console)
    assert (sweep.dir / STUDY_FILE).is_file()
    with sweep_lock(sweep.dir), pytest.raises(SweepError, match="another relayrl sweep is running"), \
            sweep_lock(sweep.dir):
        pass


def test_a_stopped_sweeps_trial_whose_run_could_not_train_is_failed_with_the_reason(project, tmp_path):
    """A trial left running whose run ended without training (its summary's failure, or 0 steps) is failed with the
    reason, counted, and never the best: it was completed with the value its run started from."""
    pytest.importorskip("optuna")
    from rich.console import Console

    from deploy.sweep.report import report
    from deploy.sweep.study import counted, distributions, open_study

    sweep = load_sweep(_sweep_file(tmp_path, project))
    sweep.dir.mkdir()
    console = Console(record=True, width=300)
    study = open_study(sweep, resume=False, console=console)
    space = distributions(sweep)
    trained, failed, untrained = study.ask(space), study.ask(space), study.ask(space)
    for trial, summary in ((trained, {"final_accuracy": 0.3, "best_accuracy": 0.3, "steps": 40}),
                           (failed, {"final_accuracy": 0.5, "best_accuracy": 0.5, "steps": 0,
                                     "failure": "the trainer took no optimizer step in 30s of RL: logs/trainer.log:52: "
                                                "ValueError: needs reference logprobs"}),
                           (untrained, {"final_accuracy": 0.5, "best_accuracy": 0.5, "steps": 0})):
        (sweep.dir / f"trial-{trial.number}").mkdir()
        (sweep.dir / f"trial-{trial.number}" / "summary.json").write_text(json.dumps(summary))
    study = open_study(sweep, resume=True, console=console)  # the sweep was stopped with the three running
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "FAIL", "FAIL"] and counted(study) == 3
    best = report(study, sweep.dir, "final", console)
    assert best["trial"] == 0
    rows = list(csv.DictReader((sweep.dir / "results.csv").read_text().splitlines()))
    assert rows[1]["state"] == "fail" and "could not train" in rows[1]["note"] and "ValueError" in rows[1]["note"]
    assert "could not train: the trainer took no optimizer step" in rows[2]["note"]
    assert "its run had ended without training: failed" in console.export_text()


FAKE_RUN = """
import json, pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path(sys.argv[1], "stopped").write_text("SIGTERM"), sys.exit(143)))
for i in range(40):
    with open(pathlib.Path(sys.argv[1], "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"elapsed_s": i * 10.0, "accuracy": 0.5 - 0.1 * i}) + "\\n")
    time.sleep(0.2)
"""


def test_a_trial_reports_each_held_out_point_and_a_pruned_one_is_stopped(tmp_path):
    """deploy/sweep/trial.py: each point the run appends to metrics.jsonl is handed over as it appears; the answer
    True (prune) stops the run with SIGTERM, and no later point is handed over."""
    from deploy.sweep.trial import TrialProcess

    run_dir = tmp_path / "trial-0"
    run_dir.mkdir()
    trial = TrialProcess(tmp_path / "trial-0.yaml", run_dir, tmp_path / "trial-0.log")
    trial.args = [sys.executable, "-c", FAKE_RUN, str(run_dir)]  # a run that writes a falling curve
    seen: list[tuple[int, float]] = []
    trial.start()
    code = trial.watch(lambda index, point: seen.append((index, point["accuracy"])) or index == 2, poll_s=0.05)
    assert code == 143 and trial.pruned and (run_dir / "stopped").read_text() == "SIGTERM"
    assert [index for index, _ in seen] == [0, 1, 2] and seen[0] == (0, 0.5)


def test_parameters_valid_alone_but_not_together_fail_their_trial_and_the_sweep_goes_on(project, tmp_path):
    optuna = pytest.importorskip("optuna")
    from rich.console import Console

    from deploy.sweep.study import Trials, counted, open_study

    sweep = load_sweep(_sweep_file(tmp_path, project, set={"training.groups_per_batch": 1}, params={
        "training.group_size": {"type": "categorical", "choices": [3, 8]},
        "training.mini_batches": {"type": "categorical", "choices": [1, 2]}}))  # 3 samples do not split in 2
    sweep.dir.mkdir()
    console = Console(record=True, width=200)
    study = open_study(sweep, resume=False, console=console)
    study.enqueue_trial({"training.group_size": 3, "training.mini_batches": 2})
    trials = Trials(study, sweep, None, None, console)
    trials.run_one(study.ask(trials.distributions))
    [failed] = study.get_trials()
    assert failed.state == optuna.trial.TrialState.FAIL and "mini_batches" in failed.user_attrs["failed"]
    assert counted(study) == 1 and not (sweep.dir / "trial-0.yaml").exists()


def test_a_shared_warmup_of_an_environments_experiment_is_made_once_from_its_transcripts(tmp_path):
    """An experiment with `env` has no data: its shared warm-up is the one its runs make (the scripted player's
    transcripts); it failed reading `data` before. A parameter of the environment changes that warm-up."""
    import io

    from rich.console import Console

    from deploy.record.run_state import whole_model
    from deploy.sweep.study import shared_warmup

    experiment = yaml.safe_load((ROOT / "examples" / "agentic" / "guess_number.yaml").read_text())
    experiment["sft"] = {"steps": 3, "batch_size": 4, "lr": 1.0e-3, "transcripts": 40, "skill": 0.0}
    (tmp_path / "guess_number.yaml").write_text(yaml.safe_dump(experiment))
    space = {"training.lr": SPACE["training.lr"]}
    sweep = load_sweep(_sweep_file(tmp_path, "guess_number.yaml", params=space))
    out = io.StringIO()
    folder = shared_warmup(sweep, Console(file=out, width=200))
    assert folder == sweep.dir / "model-sft" and whole_model(folder), out.getvalue()
    assert "guess_number transcripts" in out.getvalue()
    assert shared_warmup(sweep, Console(file=out, width=200)) == folder and "is whole" in out.getvalue()
    assert sweep.experiment({}, tmp_path / "t", warmed=folder).model.path == str(folder)
    with pytest.raises(ValueError, match="env.config.max_number change the SFT warm-up"):
        load_sweep(_sweep_file(tmp_path, "guess_number.yaml",
                               params={"env.config.max_number": {"type": "int", "low": 7, "high": 15}}))
