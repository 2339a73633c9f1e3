"""`relayrl sweep SWEEP.yaml [--resume] [--ray ADDRESS]`: hyper-parameter search over an experiment file with Optuna.

    load the sweep file (deploy/sweep/config.py: every parameter's range validated against the experiment)
    -> open the study in SWEEP_DIR/study.db (SQLite), or go on with the one there: trials it finished are kept; one
       the sweep was running when it was stopped (killed, Ctrl-C, the machine went down) is marked failed and its
       parameters queued to run again as a new trial
    -> the SFT warm-up once, in SWEEP_DIR/model-sft (`warmup: shared`, with sft.steps > 0): every trial starts RL there
    -> until `trials` are finished (completed, pruned, or failed): Optuna proposes parameters (TPE, seeded), the trial
       runs as an ordinary run in SWEEP_DIR/trial-N (`relayrl run SWEEP_DIR/trial-N.yaml`, deploy/sweep/trial.py:
       `relayrl status`, TensorBoard and `relayrl run --resume` work on it), reports each held-out evaluation as its
       run writes it, and is stopped cleanly (SIGTERM) when the median pruner says so; its value is its summary's
       final (or best) held-out mean reward. `parallel` trials at once; with --ray each places its services on the
       Ray cluster at ADDRESS (deploy/cluster/ray_launcher.py)
    -> results.csv, the table, the best trial, Optuna's plots (deploy/sweep/report.py)
"""

import concurrent.futures
import contextlib
import fcntl
import json
import pathlib
import signal
import sys
import threading

import yaml
from rich.console import Console

from deploy.record.run_state import SUMMARY_FILE
from deploy.sweep.config import WARMUP_INPUTS, Sweep, load_sweep
from deploy.sweep.report import report, trial_dir
from deploy.sweep.trial import TrialProcess

STUDY_NAME = "relayrl-sweep"
STUDY_FILE = "study.db"
WARMUP_FILE = "warmup.json"  # what the shared warm-up in model-sft was made from


class SweepError(RuntimeError):
    """The sweep cannot go on (its folder holds another sweep's study, or another sweep runs on it)."""


# ---------------------------------------------------------------- the study


def open_study(sweep: Sweep, resume: bool, console: Console):
    """The sweep's study: created, or loaded from SWEEP_DIR/study.db (SweepError if it searches another space)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # the sweep prints its own lines
    path = sweep.dir / STUDY_FILE
    if resume and not path.exists():
        raise SweepError(f"--resume: {sweep.dir} holds no study ({STUDY_FILE}) to go on with")
    existed = path.exists()
    storage = f"sqlite:///{path}"
    config = sweep.config
    # A resumed sweep's sampler is seeded past the trials it has: the same seed again would propose the
    # parameters of its first (random) trials again.
    done = len(optuna.load_study(study_name=STUDY_NAME, storage=storage).trials) if existed else 0
    if config.sampler.type == "tpe":
        sampler = optuna.samplers.TPESampler(seed=config.sampler.seed + done,
                                             n_startup_trials=config.sampler.n_startup_trials)
    else:
        sampler = optuna.samplers.RandomSampler(seed=config.sampler.seed + done)
    pruner = (optuna.pruners.NopPruner() if config.pruner.type == "none" else
              optuna.pruners.MedianPruner(n_startup_trials=config.pruner.n_startup_trials,
                                          n_warmup_steps=config.pruner.n_warmup_steps))
    study = optuna.create_study(storage=storage, study_name=STUDY_NAME, direction=config.direction,
                                sampler=sampler, pruner=pruner, load_if_exists=True)
    space = study.user_attrs.get("space")
    if space is None:
        study.set_user_attr("space", sweep.space())
    elif space != sweep.space():
        raise SweepError(f"{path} holds a study of another search (the params, objective, direction, base experiment "
                         "or `set` changed, and its trials would not compare): give the sweep another sweep_dir, or "
                         "remove the folder to start over")
    if existed:
        console.print(f"resuming the sweep in {sweep.dir}: {counted(study)} of {config.trials} trials finished")
    recover(study, sweep, console)
    return study


def counted(study) -> int:
    """Trials that count towards the sweep's `trials`: completed, pruned, or failed on their own (not interrupted)."""
    return sum(t.state.name in ("COMPLETE", "PRUNED") or (t.state.name == "FAIL" and "failed" in t.user_attrs)
               for t in study.get_trials(deepcopy=False))


def recover(study, sweep: Sweep, console: Console) -> None:
    """Trials left running by a sweep that was stopped: one whose run finished is told its value; any other is
    marked failed (interrupted) and its parameters queued to run again."""
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        summary = trial_dir(sweep.dir, trial.number) / SUMMARY_FILE
        if summary.is_file():
            ended = json.loads(summary.read_text())
            if untrained(ended):
                # A trial left running is a FrozenTrial: its attribute is set through the storage (Trial would do
                # the same), before the tell that finishes it.
                study._storage.set_trial_user_attr(trial._trial_id, "failed", untrained(ended))
                study.tell(trial.number, state=TrialState.FAIL)
                console.print(f"trial-{trial.number}: its run had ended without training: failed")
                continue
            study.tell(trial.number, objective(ended, sweep.config.objective))
            console.print(f"trial-{trial.number}: its run had finished: completed")
            continue
        study.tell(trial.number, state=TrialState.FAIL)
        study.enqueue_trial(trial.params, user_attrs={"rerun_of": trial.number})
        console.print(f"trial-{trial.number}: interrupted: marked failed; its parameters run again as a new trial")


def objective(summary: dict, which: str) -> float:
    return summary["final_accuracy" if which == "final" else "best_accuracy"]


def untrained(summary: dict) -> str | None:
    """Why a trial's run could not train (its summary's failure; no optimizer step), or None: it trained. Such a trial
    is failed, never completed with the value it started from."""
    if summary.get("failure"):
        return f"could not train: {summary['failure']}"
    return "could not train: the trainer took no optimizer step" if summary.get("steps") == 0 else None


def distributions(sweep: Sweep) -> dict:
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    made = {}
    for path, param in sweep.config.params.items():
        if param.type == "float":
            made[path] = FloatDistribution(param.low, param.high, log=param.log, step=param.step)
        elif param.type == "int":
            made[path] = IntDistribution(param.low, param.high, log=param.log, step=param.step)
        else:
            made[path] = CategoricalDistribution(param.choices)
    return made


# ---------------------------------------------------------------- the shared warm-up


def shared_warmup(sweep: Sweep, console: Console) -> pathlib.Path | None:
    """The SFT warm-up every trial starts RL from (`warmup: shared` and sft.steps > 0), in SWEEP_DIR/model-sft: made
    once, kept while the model, data, seed and sft settings it was made from stay the same; None = no shared one."""
    import shutil

    from deploy.record.run_state import whole_model

    config = sweep.experiment({}, sweep.dir)
    if sweep.config.warmup != "shared" or not config.sft.steps:
        return None
    folder, stamp = sweep.dir / "model-sft", sweep.dir / WARMUP_FILE
    made_from = config.model_dump(mode="json", include=set(WARMUP_INPUTS))
    if whole_model(folder) and stamp.is_file() and json.loads(stamp.read_text()) == made_from:
        console.print(f"the shared SFT warm-up in {folder} is whole: every trial starts RL from it")
        return folder
    import torch
    from transformers import AutoTokenizer

    from deploy.experiment import data as experiment_data
    from deploy.record.progress import Progress
    from deploy.runs.experiment_run import base_model, warm_up

    torch.set_num_threads(1)
    sweep.dir.mkdir(parents=True, exist_ok=True)
    stamp.unlink(missing_ok=True)
    shutil.rmtree(folder, ignore_errors=True)
    model_dir = base_model(config, sweep.dir, resume=False)
    if config.env is not None:  # an environment's experiment warms up on its scripted player's transcripts
        from deploy.runs import agentic

        train_tasks, _ = agentic.env_tasks(config)
        agentic.warm_up(config, model_dir, sweep.dir, train_tasks, Progress(sweep.dir, console))
    else:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        train_rows, _ = experiment_data.split(config.data, tokenizer, config.seed)
        warm_up(config, model_dir, sweep.dir, tokenizer, train_rows, Progress(sweep.dir, console), resume=False)
    stamp.write_text(json.dumps(made_from, indent=1) + "\n")
    return folder


# ---------------------------------------------------------------- the trials


class Trials:
    """Runs the study's trials, `parallel` at once, each as an ordinary run (deploy/sweep/trial.py)."""

    def __init__(self, study, sweep: Sweep, warmed: pathlib.Path | None, ray_address: str | None, console: Console):
        self.study, self.sweep, self.warmed, self.ray_address, self.console = study, sweep, warmed, ray_address, console
        self.distributions = distributions(sweep)
        self.stopping = threading.Event()
        self.live: set[TrialProcess] = set()
        self.lock = threading.Lock()

    def run_all(self) -> None:
        """Until the sweep's `trials` are finished; on an exception (SIGTERM, Ctrl-C) every trial running is stopped
        and left as it is in the study (the next start marks it interrupted)."""
        wanted, parallel = self.sweep.config.trials, self.sweep.config.parallel
        running: set[concurrent.futures.Future] = set()
        with concurrent.futures.ThreadPoolExecutor(parallel, thread_name_prefix="trial") as pool:
            try:
                while True:
                    for _ in range(min(parallel - len(running), wanted - counted(self.study) - len(running))):
                        running.add(pool.submit(self.run_one, self.study.ask(self.distributions)))
                    if not running:
                        return
                    done, running = concurrent.futures.wait(running, return_when="FIRST_COMPLETED")
                    for future in done:
                        future.result()
            finally:
                self.stopping.set()
                with self.lock:
                    trials = list(self.live)
                for trial in trials:
                    trial.stop()

    def run_one(self, trial) -> None:
        """One trial: its experiment file, its run, each held-out point reported (pruned: stopped), its value."""
        from optuna.trial import TrialState

        from deploy.record.private_files import write_private
        from services.config import ConfigError

        number, sweep = trial.number, self.sweep
        run_dir = trial_dir(sweep.dir, number)
        experiment = sweep.dir / f"trial-{number}.yaml"
        shown = ", ".join(f"{name}={_short(value)}" for name, value in trial.params.items())
        # Each bound is valid alone (checked at load); a combination may not be (a batch mini_batches do not divide).
        try:
            config = sweep.experiment(trial.params, run_dir, self.warmed)
        except ConfigError as exc:
            trial.set_user_attr("failed", f"not a valid experiment: {exc}")
            self.study.tell(trial, state=TrialState.FAIL)
            self.console.print(f"[red]trial-{number} failed[/]: {shown} is not a valid experiment: {exc}")
            return
        write_private(experiment, f"# trial {number} of the sweep {sweep.file}: `relayrl run` this file to run it "
                      "again\n" + yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False),
                      private_folder=False)  # owner-only: an experiment's client tokens may be in it
        self.console.print(f"trial-{number}: {shown}  (run folder {run_dir}, log {run_dir}.log)")
        process = TrialProcess(experiment, run_dir, sweep.dir / f"trial-{number}.log", self.ray_address)
        with self.lock:
            if self.stopping.is_set():
                return
            process.start()
            self.live.add(process)

        def on_point(index: int, point: dict) -> bool:
            self.console.print(f"trial-{number}: held-out {point['accuracy']:.3f} at {point['elapsed_s']:.0f}s of RL "
                               f"(optimizer step {point.get('step', 0)})", highlight=False)
            # Point 0, the start of RL, is the warm-up's (the same for every trial of a shared one): reported, it
            # would be every trial's best so far, and the median pruner would compare that.
            if index == 0:
                return False
            trial.report(point["accuracy"], index - 1)
            # A point at the end of the budget is the run's last: it has spent its time, so it completes.
            ending = point["elapsed_s"] >= config.training.time_budget_s
            if ending or self.stopping.is_set() or not trial.should_prune():
                return False
            why = (f"pruned at evaluation {index - 1} of RL ({point['elapsed_s']:.0f}s, held-out "
                   f"{point['accuracy']:.3f}): its best is below the median of earlier trials there")
            self.console.print(f"trial-{number}: {why}")
            with open(process.log_path, "a") as log:
                log.write(f"relayrl sweep: {why}; stopping the run (SIGTERM)\n")
            return True

        code = process.watch(on_point)
        with self.lock:
            self.live.discard(process)
        if self.stopping.is_set():  # the sweep is stopping: the trial stays running in the study
            return
        summary = json.loads((run_dir / SUMMARY_FILE).read_text()) if (run_dir / SUMMARY_FILE).is_file() else None
        why = untrained(summary) if summary is not None else None
        if process.pruned:
            self.study.tell(trial, state=TrialState.PRUNED)
        elif code == 0 and summary is not None and why is None:
            value = objective(summary, sweep.config.objective)
            self.study.tell(trial, value)
            self.console.print(f"trial-{number}: completed, value {value:.4f}")
        else:  # a run that failed, or could not train: never completed with its start value, never the best
            trial.set_user_attr("failed", f"relayrl run exited {code}: {why or f'see trial-{number}.log'}")
            self.study.tell(trial, state=TrialState.FAIL)
            self.console.print(f"[red]trial-{number} failed[/] (exit {code}): {why or 'its run failed'}; last lines "
                               f"of its log:\n{_tail(sweep.dir / f'trial-{number}.log')}", highlight=False)


def _short(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _tail(path: pathlib.Path, lines: int = 15) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


@contextlib.contextmanager
def sweep_lock(folder: pathlib.Path):
    """Held while a sweep runs in `folder`: a second `relayrl sweep` on it is refused, not run beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".sweep.lock", "w") as file:
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SweepError(f"another relayrl sweep is running in {folder}") from None
        yield


# ---------------------------------------------------------------- the command


def run_sweep(sweep: Sweep, resume: bool = False, ray_address: str | None = None,
              console: Console | None = None) -> dict | None:
    """The whole sweep; the best trial's results row (None when no trial completed)."""
    if console is None:  # a path or a trial's parameters on one line; in a log, a table as wide as it needs
        console = Console(soft_wrap=True)
        console = console if console.is_terminal else Console(soft_wrap=True, width=240)
    with sweep_lock(sweep.dir):
        study = open_study(sweep, resume, console)
        warmed = shared_warmup(sweep, console)
        Trials(study, sweep, warmed, ray_address, console).run_all()
        return report(study, sweep.dir, sweep.config.objective, console)


class Stopped(BaseException):
    """SIGTERM: unwinds through Trials.run_all's finally, which stops the trials running (as Ctrl-C does)."""


def _stop_on_sigterm(signum, frame) -> None:
    raise Stopped


def main(path: str, resume: bool = False, ray_address: str | None = None) -> int:
    from services.config import ConfigError

    try:
        sweep = load_sweep(path)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"relayrl sweep: {exc}", file=sys.stderr)
        return 2
    try:
        import optuna  # noqa: F401
        import plotly  # noqa: F401
    except ImportError as exc:
        print(f"relayrl sweep needs Optuna and plotly ({exc}): pip install -e '.[sweep]'", file=sys.stderr)
        return 2
    if ray_address is not None:
        try:
            import ray  # noqa: F401
        except ImportError as exc:
            print(f"relayrl sweep --ray needs Ray ({exc}): pip install -e '.[ray]'", file=sys.stderr)
            return 2
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        best = run_sweep(sweep, resume, ray_address)
    except SweepError as exc:
        print(f"relayrl sweep: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Stopped) as exc:
        print("relayrl sweep: interrupted; the trials it ran are stopped; run it again to go on", file=sys.stderr)
        return 128 + (signal.SIGINT if isinstance(exc, KeyboardInterrupt) else signal.SIGTERM)
    return 0 if best is not None else 1
