"""`relayrl run --resume RUN_DIR`: go on with a run that stopped (killed, or the machine went down) from what
its folder holds (deploy/record/run_state.py), under the config it recorded at its start.

The run is an experiment file's (`job: experiment` in the recorded config: deploy/runs/experiment_run.py; the quickstart
is one). It goes on on a Ray cluster with `--ray ADDRESS` (deploy/cluster/ray_launcher.py: its services are placed again on
their groups, on new addresses; the run folder is on a filesystem every node sees).
The agentic job (deploy/runs/agentic.py) runs its own RL loop, which keeps no RL clock or curve to resume yet.
"""

import pathlib
import sys

import yaml

from deploy.record.run_state import CONFIG_FILE, SUMMARY_FILE, finished


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
    if job != "experiment":
        what = f"`job: {job}`" if job else "no `job:` (a run of the former built-in quickstart job)"
        print(f"relayrl run --resume: {config_path} records {what}: only the run of an experiment file can be resumed",
              file=sys.stderr)
        return 2
    from deploy.runs.experiment_run import main as run_experiment

    # run_dir: where the run is now, whatever path it was started under
    return run_experiment(str(config_path), [f"run_dir={folder}"], resume=True, ray_address=ray_address)
