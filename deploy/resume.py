"""`relayrl run --resume RUN_DIR`: go on with a run that stopped (killed, or the machine went down) from what
its folder holds (deploy/run_state.py), under the config it recorded at its start.

The job is told by the recorded config: `job: experiment` (deploy/experiment_run.py), none (the quickstart).
An experiment-file run goes on on a Ray cluster with `--ray ADDRESS` (deploy/ray_launcher.py: its services are
placed again on their groups, on new addresses; the run folder is on a filesystem every node sees).
The agentic job (deploy/agentic.py) runs its own RL loop, which keeps no RL clock or curve to resume yet.
"""

import pathlib
import sys

import yaml

from deploy.run_state import CONFIG_FILE, SUMMARY_FILE, finished


def main(run_dir: str, ray_address: str | None = None) -> int:
    folder = pathlib.Path(run_dir).resolve()
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        print(f"relayrl run --resume: {folder} is not a run folder (no {CONFIG_FILE})", file=sys.stderr)
        return 2
    config = yaml.safe_load(config_path.read_text())
    if not isinstance(config, dict):
        print(f"relayrl run --resume: {config_path} holds no run config", file=sys.stderr)
        return 2
    if finished(folder):
        print(f"relayrl run --resume: the run in {folder} finished already ({SUMMARY_FILE}): nothing to resume")
        return 0
    job = config.get("job")
    if ray_address is not None and job != "experiment":
        print(f"relayrl run --resume --ray: only the run of an experiment file goes on on Ray; {folder} holds a "
              f"`job: {job or 'quickstart --config'}` run", file=sys.stderr)
        return 2
    overrides = [f"run_dir={folder}"]  # where the run is now, whatever path it was started under
    if job == "experiment":
        from deploy.experiment_run import main as run_experiment

        return run_experiment(str(config_path), overrides, resume=True, ray_address=ray_address)
    if job is None:
        from deploy.quickstart import main as quickstart

        return quickstart(str(config_path), overrides, resume=True)
    print(f"relayrl run --resume: a `job: {job}` run cannot be resumed (the quickstart and experiment files can)",
          file=sys.stderr)
    return 2
