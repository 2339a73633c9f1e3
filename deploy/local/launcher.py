"""Where a run's processes start when they start on this machine: the launcher the RL phase (deploy/rl/pipeline.py)
and the rollout replicas (deploy/local/replicas.py) use unless given another (deploy/cluster/ray_launcher.py: on Ray nodes).

A launcher answers four questions: start this service (a started, serving deploy.local.service_process.ServiceProcess), make
this client process (a deploy.local.supervisor.Process the supervisor starts), release what held a stopped process, and
which trainer settings depend on where the trainer runs.
"""

import pathlib

from deploy.local.service_process import start_service
from deploy.local.supervisor import Process


class LocalLauncher:
    """Where a run's processes start: each on this machine (deploy/cluster/ray_launcher.py places them on Ray nodes)."""

    def service(self, name: str, overrides: dict, log_dir: pathlib.Path, registry: pathlib.Path,
                env: dict[str, str] | None = None, label: str | None = None, client=None):
        """A started, serving service process (deploy.local.service_process.ServiceProcess); `label` names it in the run (a
        rollout replica: "rollout-2"), `name` is what `relayrl serve` runs, `client` how its health is checked."""
        return start_service(name, overrides, log_dir=log_dir, registry=registry, env=env, label=label, client=client)

    def process(self, name: str, args: list[str], log_path: pathlib.Path, exit_zero_is_done: bool = False,
                heartbeat: pathlib.Path | None = None) -> Process:
        """A client process (`python ARGS`) not yet started (deploy.local.supervisor.Process)."""
        return Process(name, args, log_path, exit_zero_is_done, heartbeat)

    def release(self, label: str) -> None:
        """Nothing holds a stopped process here (a Ray run's agent ends: deploy/cluster/ray_launcher.py)."""

    def trainer_settings(self) -> dict:
        """TrainerConfig fields that depend on where the trainer runs (none here: loopback)."""
        return {}
