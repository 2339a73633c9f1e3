"""Where each service of an experiment runs: node groups, and for each service its group, replicas and resources.

    groups:    named sets of nodes: hosts (Ray, SSH) or a selector (Kubernetes node labels), devices per node
    services:  buffer, reward, rollout (each a gRPC server) and the trainer (torchrun), each placed on a group

No group anywhere (the default) means every service is a process on this machine, as `relayrl run` starts them.
A group's `name` is also the Ray custom resource that marks its nodes (`ray start --resources '{"inference": 1}'`
on each inference node), and it names Kubernetes objects, so it is a DNS label. `relayrl deploy check FILE`
validates a file and prints the placement as a table (deploy/inspect/placement_table.py).
"""

from typing import Literal

from pydantic import Field

from services.config import AuthConfig, ClientConfig, Strict, TLSConfig

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A Kubernetes quantity of bytes: 512Mi, 16Gi, 1G, 1500000000.
MEMORY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"
# The port each gRPC service listens on in a cluster when its `port` is 0 (on this machine 0 = any free port).
CLUSTER_PORTS = {"buffer": 50051, "reward": 50052, "rollout": 50053}
SERVERS = tuple(CLUSTER_PORTS)  # the gRPC services; the trainer is a client of them


class NodeGroup(Strict):
    """A named set of nodes that services are placed on."""

    name: str = Field(pattern=DNS_LABEL, max_length=63, description="The group's name: what services name in their "
                      "`group`, the Ray custom resource its nodes carry, and a part of Kubernetes object names "
                      "(lower-case letters, digits and '-').")
    hosts: list[str] = Field(default_factory=list, description="The group's nodes by host name or address (a Ray or "
                             "SSH launch); empty = whichever nodes carry the selector or the Ray resource.")
    selector: dict[str, str] = Field(default_factory=dict, description="Kubernetes node labels that pick the group's "
                                     "nodes (a nodeSelector), e.g. {node.kubernetes.io/instance-type: p5.48xlarge}.")
    devices_per_node: int = Field(0, ge=0, description="Accelerators (GPUs) on each node; 0 = none or not stated "
                                  "(then the per-node process and GPU counts are not checked against it).")


class Resources(Strict):
    """What one replica (the trainer: one node's processes) asks for; local runs ignore it."""

    cpu: float | None = Field(None, gt=0, description="CPU cores; None = no request.")
    memory: str | None = Field(None, pattern=MEMORY, description="Memory as a Kubernetes quantity (16Gi, 512Mi); "
                               "None = no request.")
    gpus: int = Field(0, ge=0, description="GPUs (on Kubernetes through the device plugin, nvidia.com/gpu).")


class ServicePlacement(Strict):
    """Where one gRPC service runs, how many of it, what it asks for, how it is secured, and its extra settings."""

    where: Literal["local"] = Field("local", description="Kept for older files; `group` says where a service runs.")
    group: str | None = Field(None, description="The node group it runs on (a name under `groups`); None = this "
                              "machine.")
    replicas: int = Field(1, ge=1, description="Copies of the service (rollout and reward only: the buffer is one "
                          "process, the single owner of its log). A run (local or --ray) starts rollout replicas "
                          "behind a router (deploy/local/replicas.py; `relayrl deploy scale` changes their number while it "
                          "runs; `relayrl deploy k8s` renders the router in front of them), and reward replicas "
                          "reward-1..N with no router: every client calls one gRPC target naming them all and balances "
                          "its calls round-robin over those that answer (on Kubernetes: the headless Service's name).")
    port: int = Field(0, ge=0, le=65535, description="The port it listens on; 0 = any free port on this machine "
                      "(relayrl doctor checks a fixed one is free). On a cluster 0 means the service's CLUSTER_PORTS one.")
    resources: Resources = Field(default_factory=Resources, description="Per replica; for Ray and Kubernetes.")
    tls: TLSConfig | None = Field(None, description="Server TLS (cert, key; client_ca for mTLS): "
                                  "services.config.TLSConfig (relative paths: to the experiment file). Honoured by "
                                  "every launcher (local, --ray, k8s). Off = plain text.")
    auth: AuthConfig | None = Field(None, description="Bearer tokens -> roles and which roles may call which RPC: "
                                    "services.config.AuthConfig (prefer tokens_file to tokens written here; a run "
                                    "copies the merged table to an owner-only file, deploy/local/security.py).")
    client: ClientConfig = Field(default_factory=ClientConfig, description="How the run's own clients (driver, "
                                 "trainer, evaluation, the rollout router, health checks, `relayrl status RUN_DIR`) "
                                 "reach this service: token or token_file, ca_cert, cert/key (mTLS), server_name "
                                 "(services.config.ClientConfig; relative paths: to the experiment file).")
    settings: dict = Field(default_factory=dict, description="Extra --set overrides of the service's own config "
                           "(e.g. engine.max_num_seqs for rollout).")


class WeightSync(Strict):
    """Where the trainer's rank 0 hosts the rendezvous of each weight broadcast to the rollout replicas."""

    address: str | None = Field(None, description="Host or address of rank 0 that rollout replicas can reach; "
                                "None = loopback on this machine, rank 0's stable DNS name on Kubernetes.")
    port: int = Field(0, ge=0, le=65535, description="Port of the rendezvous store; 0 = any free port.")


class TrainerPlacement(Strict):
    """Where the trainer runs: a torchrun job of `nodes` x `procs_per_node` processes on one group."""

    group: str | None = Field(None, description="The node group it runs on; None = this machine.")
    nodes: int = Field(1, ge=1, description="Nodes of the torchrun job (torchrun --nnodes).")
    procs_per_node: int = Field(1, ge=1, description="Processes per node (torchrun --nproc-per-node); at most the "
                                "group's devices_per_node when that is given.")
    rendezvous_port: int = Field(29400, ge=1, le=65535, description="Port of torchrun's static rendezvous "
                                 "(--master-port) on the first node, hosted by its torchrun.")
    resources: Resources = Field(default_factory=Resources, description="Per node.")
    weight_sync: WeightSync = Field(default_factory=WeightSync)
    settings: dict = Field(default_factory=dict, description="Extra trainer.config.TrainerConfig fields (e.g. "
                           "{publish: {backend: nccl}}).")

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


class ServicesSection(Strict):
    """The three services of a run and its trainer."""

    buffer: ServicePlacement = Field(default_factory=ServicePlacement)
    reward: ServicePlacement = Field(default_factory=ServicePlacement)
    rollout: ServicePlacement = Field(default_factory=ServicePlacement)
    trainer: TrainerPlacement = Field(default_factory=TrainerPlacement)

    def placed(self) -> dict[str, ServicePlacement | TrainerPlacement]:
        """Every service by name, in the order a run starts them."""
        return {"buffer": self.buffer, "reward": self.reward, "rollout": self.rollout, "trainer": self.trainer}


class KubernetesSection(Strict):
    """What `relayrl deploy k8s FILE` needs beyond the placement (deploy/cluster/k8s.py renders the manifests)."""

    image: str | None = Field(None, description="Container image with relayrl installed (its `relayrl` command, "
                              "`python -m trainer`, torchrun); every pod runs it.")
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = "IfNotPresent"
    namespace: str = Field("default", pattern=DNS_LABEL, description="Namespace of every object.")
    name: str = Field("relayrl", pattern=DNS_LABEL, max_length=40, description="Prefix of every object's name and "
                      "the `app.kubernetes.io/instance` label (two experiments in one namespace need two names).")
    project_claim: str | None = Field(None, description="A PersistentVolumeClaim holding the experiment's folder "
                                      "(model, data, reward modules), mounted in every pod at project_path; the run "
                                      "(run_dir: buffer log, checkpoints, prompts) is written in it too, so it must be "
                                      "ReadWriteMany when pods on several nodes share it.")
    project_path: str = Field("/project", pattern=r"^/", description="Where the claim is mounted: the experiment's "
                              "relative paths are taken from it.")


def placement_problems(groups: list[NodeGroup], services: ServicesSection) -> list[str]:
    """What is wrong with placing `services` on `groups`, each problem naming its field; [] = nothing."""
    problems = []
    by_name: dict[str, NodeGroup] = {}
    for index, group in enumerate(groups):
        if group.name in by_name:
            problems.append(f"groups.{index}.name: {group.name!r} names two groups")
        by_name[group.name] = group
    known = ", ".join(sorted(by_name)) or "none are defined"
    if services.buffer.replicas != 1:
        problems.append(f"services.buffer.replicas: {services.buffer.replicas}, but the buffer runs as exactly one "
                        "process (the single owner of its log); only rollout and reward have replicas")
    local_ports: dict[int, str] = {}
    for name, placement in services.placed().items():
        field = f"services.{name}"
        group = by_name.get(placement.group) if placement.group is not None else None
        if placement.group is not None and group is None:
            problems.append(f"{field}.group: {placement.group!r} is not a group (groups: {known})")
        if isinstance(placement, ServicePlacement):
            token = placement.client.token or placement.client.token_file
            if placement.auth is not None and not token:
                problems.append(f"{field}.client.token: {name} has auth on, so the run's clients need a token (token or "
                                "token_file)")
            if placement.tls is not None and placement.client.ca_cert is None:
                problems.append(f"{field}.client.ca_cert: {name} serves TLS, so the run's clients need the CA "
                                "that signed its certificate")
            if placement.group is not None and token and placement.tls is None:
                problems.append(f"{field}.tls: a token never crosses a network in plain text (services/client.py): "
                                f"{name} on group {placement.group!r} needs TLS for its clients' token")
            if placement.group is None and placement.port:
                if placement.port in local_ports:
                    problems.append(f"{field}.port: {placement.port} is also {local_ports[placement.port]}.port "
                                    "on this machine")
                local_ports.setdefault(placement.port, field)
        if group is None or not group.devices_per_node:
            continue
        if placement.resources.gpus > group.devices_per_node:
            problems.append(f"{field}.resources.gpus: {placement.resources.gpus}, but group {group.name!r} has "
                            f"{group.devices_per_node} devices per node")
        if isinstance(placement, ServicePlacement) and group.hosts and (
                placement.replicas * placement.resources.gpus > len(group.hosts) * group.devices_per_node):
            problems.append(f"{field}.replicas: {placement.replicas} x {placement.resources.gpus} GPUs, but group "
                            f"{group.name!r} has {len(group.hosts)} hosts x {group.devices_per_node} devices")
        if isinstance(placement, TrainerPlacement) and placement.procs_per_node > group.devices_per_node:
            problems.append(f"{field}.procs_per_node: {placement.procs_per_node}, but group {group.name!r} has "
                            f"{group.devices_per_node} devices per node")
    trainer = services.trainer
    group = by_name.get(trainer.group) if trainer.group is not None else None
    if group is not None and group.hosts and trainer.nodes > len(group.hosts):
        problems.append(f"services.trainer.nodes: {trainer.nodes}, but group {group.name!r} lists "
                        f"{len(group.hosts)} hosts")
    return problems


def _replica_problems(name: str, placement: ServicePlacement) -> list[str]:
    """What a run (local or --ray) cannot honour of a service's replicas. Rollout replicas run behind a router
    (deploy/local/replicas.py), which takes the fixed port; reward replicas each take a free port of their own and their
    clients call one target naming them all (deploy.rl.pipeline.start_reward), so a fixed port has no one to go to, and
    TLS has no host name to verify unless client.server_name gives one."""
    field = f"services.{name}"
    if placement.replicas > 1 and name == "buffer":  # placement_problems refuses it too: the log has one owner
        return [f"{field}.replicas: {placement.replicas}"]
    if placement.replicas > 1 and name == "reward" and placement.port:
        port = f"{field}.port: {placement.port} with {placement.replicas} replicas"
        return [f"{port} (each replica takes a free port: set port: 0)"]
    if placement.replicas > 1 and name == "reward" and placement.tls is not None and not placement.client.server_name:
        problem = (f"{field}.client.server_name: {placement.replicas} replicas serving TLS are called through one "
                   "target naming their addresses, which names no host to verify: set the name their certificate carries")
        return [problem]
    return []


def local_problems(services: ServicesSection) -> list[str]:
    """What `relayrl run` (one process per service, all on this machine, on loopback) cannot honour; [] = none."""
    problems = []
    for name, placement in services.placed().items():
        field = f"services.{name}"
        if placement.group is not None:
            problems.append(f"{field}.group: {placement.group!r}")
        if isinstance(placement, ServicePlacement):
            problems += _replica_problems(name, placement)
    trainer = services.trainer
    if trainer.world_size > 1:
        problems.append(f"services.trainer: {trainer.nodes} x {trainer.procs_per_node} processes")
    return problems


def ray_problems(services: ServicesSection) -> list[str]:
    """What `relayrl run --ray` (deploy/cluster/ray_launcher.py) cannot honour yet, each naming its field; [] = none."""
    problems = []
    for name, placement in services.placed().items():
        if isinstance(placement, ServicePlacement):
            problems += _replica_problems(name, placement)
    trainer = services.trainer
    if trainer.nodes > 1 and trainer.group is None:  # its nodes are spread over the nodes carrying its group
        problems.append(f"services.trainer.group: none, but a trainer on {trainer.nodes} nodes needs the group "
                        "whose Ray resource marks its nodes")
    return problems
