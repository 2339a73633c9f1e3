"""`relayrl sweep SWEEP.yaml` (deploy/sweep.py): the sweep file's validation, a trial's parameters applied to the
experiment, the results and plots of a study; and (slow) a sweep of the quickstart that finishes and names its best
trial, and the same sweep killed after two trials that resumes and finishes."""

import csv
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from deploy.experiment import load_experiment
from deploy.quickstart_project import write_project
from deploy.sweep_config import load_sweep, trial_experiment
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

    from deploy.sweep_report import report

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


# ---------------------------------------------------------------- slow: sweeps of the quickstart

QUICK = {"training.time_budget_s": 30, "evaluation.every_s": 10, "sft.steps": 300}
QUICK_SPACE = {"training.lr": {"type": "float", "low": 3.0e-5, "high": 1.0e-3, "log": True},
               "training.temperature": {"type": "categorical", "choices": [0.7, 1.0]}}


@pytest.fixture(scope="module")
def warmed(project, tmp_path_factory) -> pathlib.Path:
    """The quickstart's SFT warm-up for these sweeps, made once by the sweep's own shared warm-up (a folder holding
    model-sft/ and warmup.json): each sweep below starts from a copy, as a sweep resumed in its folder does."""
    from rich.console import Console

    from deploy.sweep import shared_warmup

    folder = tmp_path_factory.mktemp("warmup")
    sweep = load_sweep(_quick_sweep(folder, project))
    started = time.monotonic()
    assert shared_warmup(sweep, Console()) == sweep.dir / "model-sft"
    print(f"shared SFT warm-up ({QUICK['sft.steps']} steps): {time.monotonic() - started:.0f}s")
    return sweep.dir


def _quick_sweep(folder: pathlib.Path, project: pathlib.Path) -> pathlib.Path:
    return _sweep_file(folder, project, set=QUICK, params=QUICK_SPACE, trials=4, objective="final",
                       sampler={"seed": 0, "n_startup_trials": 2}, pruner={"n_startup_trials": 2, "n_warmup_steps": 1})


def _start_sweep(folder: pathlib.Path, *flags: str, **popen) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "deploy", "sweep", str(folder / "sweep.yaml"), *flags], env=env,
                            cwd=folder, text=True, **popen)


def _prepared(folder: pathlib.Path, project: pathlib.Path, warmed: pathlib.Path) -> pathlib.Path:
    """A sweep folder holding the shared warm-up already (copied): the sweep keeps it, as a resumed one does."""
    _quick_sweep(folder, project)
    shutil.copytree(warmed / "model-sft", folder / "sweep" / "model-sft")
    shutil.copyfile(warmed / "warmup.json", folder / "sweep" / "warmup.json")
    return folder / "sweep"


def _rows(sweep_dir: pathlib.Path) -> list[dict]:
    return list(csv.DictReader((sweep_dir / "results.csv").read_text().splitlines()))


def _left_running(sweep_dir: pathlib.Path, within_s: float = 15.0) -> list[str]:
    """Command lines of processes still naming `sweep_dir` (a trial's services, trainer, driver) after `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        left = []
        for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
            try:
                args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:  # ended meanwhile
                continue
            if str(sweep_dir) in args:
                left.append(args)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def _assert_named_best(stdout: str, sweep_dir: pathlib.Path) -> dict:
    rows = _rows(sweep_dir)
    completed = [r for r in rows if r["state"] == "complete"]
    best = max(completed, key=lambda r: float(r["value"]))
    assert f"best trial: trial-{best['trial']}" in stdout, stdout[-3000:]
    run = pathlib.Path(best["run_dir"])
    summary = json.loads((run / "summary.json").read_text())
    assert float(best["value"]) == summary["final_accuracy"] and (run / "config.yaml").is_file()
    assert (run / "tensorboard").is_dir() and (run / "services.json").is_file()  # an ordinary run folder
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["path"] == str(sweep_dir / "model-sft")
    for name in ("optimization_history", "intermediate_values"):
        assert (sweep_dir / "plots" / f"{name}.png").is_file() and (sweep_dir / "plots" / f"{name}.html").is_file()
    assert (sweep_dir / "plots" / "param_importances.png").is_file() == (len(completed) >= 3)
    print(f"best: trial-{best['trial']} value {best['value']} start {best['start']} "
          f"training.lr={best['training.lr']} training.temperature={best['training.temperature']}")
    return best


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_sweep_of_four_quickstart_trials_finishes_and_names_the_best(project, warmed, tmp_path):
    sweep_dir = _prepared(tmp_path, project, warmed)
    started = time.monotonic()
    sweep = _start_sweep(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stdout, _ = sweep.communicate(timeout=840)
    assert sweep.returncode == 0, stdout[-4000:]
    print(f"4 trials: {time.monotonic() - started:.0f}s")
    rows = _rows(sweep_dir)
    assert [r["trial"] for r in rows] == ["0", "1", "2", "3"]
    assert all(r["state"] in ("complete", "pruned") for r in rows), rows
    assert "is whole: every trial starts RL from it" in stdout  # the warm-up is not run again
    assert not _left_running(sweep_dir)  # a pruned trial's run stopped every process it started
    for row in rows:
        print(f"trial-{row['trial']} {row['state']} value {row['value']} evaluations {row['evaluations']} "
              f"lr {row['training.lr']} temperature {row['training.temperature']}")
    _assert_named_best(stdout, sweep_dir)


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for task in pathlib.Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                children = {int(c) for c in (task / "children").read_text().split()}
            except FileNotFoundError:
                continue
            todo.extend(children - found)
            found |= children
    return found


def _alive(pid: int) -> bool:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_sweep_killed_after_two_trials_resumes_and_finishes_four(project, warmed, tmp_path):
    """SIGKILL of the sweep while its third trial trains: the trial's run stops every process it started (the
    parent-death signal), and `relayrl sweep --resume` keeps the two finished trials, marks the third failed, runs
    its parameters again and finishes four."""
    sweep_dir = _prepared(tmp_path, project, warmed)
    started = time.monotonic()
    with open(tmp_path / "first.log", "w") as log:
        sweep = _start_sweep(tmp_path, stdout=log, stderr=subprocess.STDOUT)
    curve = sweep_dir / "trial-2" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (curve.is_file() and curve.read_text().strip()):  # trial-2 measured its start of RL
        assert sweep.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the third trial never started RL"
        time.sleep(0.5)
    interrupted_at = time.monotonic() - started
    processes = _descendants(sweep.pid)
    assert len(processes) >= 6  # the trial's run, its buffer, reward, rollout, driver, trainer
    sweep.send_signal(signal.SIGKILL)
    sweep.wait(10)
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not [pid for pid in processes if _alive(pid)], "the killed sweep's trial left processes running"

    resumed = _start_sweep(tmp_path, "--resume", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    stdout, _ = resumed.communicate(timeout=900)
    assert resumed.returncode == 0, stdout[-4000:]
    print(f"killed at {interrupted_at:.0f}s (trial-2 training), resumed and finished: "
          f"{time.monotonic() - started:.0f}s in all")
    assert "resuming the sweep" in stdout and "trial-2: interrupted" in stdout
    rows = {r["trial"]: r for r in _rows(sweep_dir)}
    assert set(rows) == {"0", "1", "2", "3", "4"}
    assert rows["2"]["state"] == "fail" and rows["2"]["note"].startswith("interrupted")
    assert rows["3"]["note"] == "re-run of trial-2"
    assert (rows["3"]["training.lr"], rows["3"]["training.temperature"]) == (
        rows["2"]["training.lr"], rows["2"]["training.temperature"])
    assert sum(r["state"] in ("complete", "pruned") for r in rows.values()) == 4
    assert not _left_running(sweep_dir)
    _assert_named_best(stdout, sweep_dir)


def test_a_stopped_sweeps_trials_are_kept_completed_or_run_again(project, tmp_path):
    """What the next start of a sweep finds in its study.db: finished trials kept; a trial left running whose run
    finished is completed from its summary; one whose run did not is failed and its parameters queued again; the
    count goes on to `trials`; a study of another search is refused; so is a second sweep in the same folder."""
    optuna = pytest.importorskip("optuna")
    from rich.console import Console

    from deploy.sweep import STUDY_FILE, SweepError, counted, distributions, open_study, sweep_lock

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


FAKE_RUN = """
import json, pathlib, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path(sys.argv[1], "stopped").write_text("SIGTERM"), sys.exit(143)))
for i in range(40):
    with open(pathlib.Path(sys.argv[1], "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"elapsed_s": i * 10.0, "accuracy": 0.5 - 0.1 * i}) + "\\n")
    time.sleep(0.2)
"""


def test_a_trial_reports_each_held_out_point_and_a_pruned_one_is_stopped(tmp_path):
    """deploy/sweep_trial.py: each point the run appends to metrics.jsonl is handed over as it appears; the answer
    True (prune) stops the run with SIGTERM, and no later point is handed over."""
    from deploy.sweep_trial import TrialProcess

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

    from deploy.sweep import Trials, counted, open_study

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
