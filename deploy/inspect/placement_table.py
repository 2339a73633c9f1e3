"""`relayrl deploy check FILE`: validate an experiment file and print where each service runs, as one table.

One row per service: its group, replicas (the trainer: nodes x processes), the group's nodes (hosts or selector),
devices per node, what each replica asks for, its ports and how it is secured. Exit 2 with the problem named
(the field and why) when the file is invalid.
"""

import sys

from rich.console import Console
from rich.table import Table

from deploy.experiment.placement import (
    CLUSTER_PORTS,
    NodeGroup,
    Resources,
    ServicePlacement,
    TrainerPlacement,
)
from deploy.experiment.schema import ExperimentConfig, load_experiment

COLUMNS = ("service", "group", "replicas", "nodes", "devices/node", "resources", "ports", "security")


def _nodes(group: NodeGroup | None) -> str:
    if group is None:
        return "this machine"
    if group.hosts:
        return ", ".join(group.hosts)
    if group.selector:
        return ", ".join(f"{key}={value}" for key, value in group.selector.items())
    return f"any node (Ray: those with resource {group.name!r})"


def _resources(resources: Resources) -> str:
    parts = [f"cpu {resources.cpu:g}" if resources.cpu else "", f"memory {resources.memory}" if resources.memory
             else "", f"gpus {resources.gpus}" if resources.gpus else ""]
    return ", ".join(filter(None, parts)) or "-"


def _ports(name: str, placement: ServicePlacement | TrainerPlacement) -> str:
    if isinstance(placement, TrainerPlacement):
        weights = f"weights {placement.weight_sync.port or 'any free'}"
        # torchrun's rendezvous is the cluster's; a local trainer is one process
        return weights if placement.group is None else f"rendezvous {placement.rendezvous_port}, {weights}"
    if placement.port:
        return str(placement.port)
    return "any free" if placement.group is None else str(CLUSTER_PORTS[name])


def _security(placement: ServicePlacement | TrainerPlacement) -> str:
    if isinstance(placement, TrainerPlacement):
        return "-"
    tls = placement.tls
    parts = ["mTLS" if tls and tls.client_ca else "TLS" if tls else "", "tokens" if placement.auth else ""]
    return " + ".join(filter(None, parts)) or "plain"


def rows(config: ExperimentConfig) -> list[tuple[str, ...]]:
    """The table's rows, one per service, in the order a run starts them."""
    groups = {group.name: group for group in config.groups}
    out = []
    for name, placement in config.services.placed().items():
        group = groups.get(placement.group) if placement.group is not None else None
        if isinstance(placement, TrainerPlacement):
            replicas = f"{placement.nodes} node{'s' * (placement.nodes > 1)} x {placement.procs_per_node}"
        else:
            replicas = str(placement.replicas)
        out.append((name, placement.group or "-", replicas, _nodes(group),
                    str(group.devices_per_node or "-") if group else "-", _resources(placement.resources),
                    _ports(name, placement), _security(placement)))
    return out


def table(config: ExperimentConfig, title: str) -> Table:
    view = Table(title=title, header_style="bold")
    for column in COLUMNS:
        view.add_column(column)
    for row in rows(config):
        view.add_row(*row)
    return view


def main(path: str, overrides: list[str] | None = None, console: Console | None = None) -> int:
    from services.config import ConfigError

    try:
        config = load_experiment(path, overrides or [])
    except (ConfigError, FileNotFoundError) as exc:
        print(f"relayrl deploy check: {exc}", file=sys.stderr)
        return 2
    console = console or Console(width=160)
    console.print(table(config, f"placement of {path}"))
    return 0
