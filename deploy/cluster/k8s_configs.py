"""What each process of an experiment is told on Kubernetes: the config files `relayrl deploy k8s` puts in its ConfigMap.

They come from the same functions a local run uses (deploy/rl/plan.py `pipeline_plan`,
deploy/rl/config.py), with the services' stable DNS names for addresses, every path under the project volume,
and TLS files and tokens at the paths where their Secrets are mounted. With rollout replicas
(services.rollout.replicas > 1) the driver and the trainer reach them through the rollout router (ROUTER,
rollout/router/router.py), which is told each replica's stable StatefulSet name; the trainer publishes to the replicas the
router lists (publish.receivers_from). A token never goes into a config file: the container gets it from a Secret as
an environment variable, and `--set ...token=$(VAR)` in its arguments (Kubernetes expands it).
"""

import pathlib

from deploy.experiment.placement import CLUSTER_PORTS, SERVERS, KubernetesSection, ServicePlacement
from deploy.experiment.schema import ExperimentConfig
from deploy.local.security import client_files, server_security
from services.config import TLSConfig

CONFIG_DIR = "/etc/relayrl"  # the ConfigMap: experiment.yaml and SERVICE.yaml of each process
SECRET_DIR = "/etc/relayrl/secrets"  # SERVICE-tls/, SERVICE-auth/ (servers), clients/ (driver, trainer)
METRICS_PORT = 9090  # Prometheus /metrics of every gRPC service
ROUTER = "rollout-router"  # the component (objects, config file) of the router in front of rollout replicas


def object_name(k8s: KubernetesSection, component: str) -> str:
    return f"{k8s.name}-{component}"


def host(k8s: KubernetesSection, component: str, index: int | None = None) -> str:
    """The stable DNS name of a headless Service, or of its pod `index` (StatefulSet ordinal, Job index)."""
    service = object_name(k8s, component)
    pod = f"{service}-{index}." if index is not None else ""
    return f"{pod}{service}.{k8s.namespace}.svc.cluster.local"


def port(name: str, placement: ServicePlacement) -> int:
    return placement.port or CLUSTER_PORTS[name]


def routed(services) -> bool:
    """Whether the rollout runs as replicas behind a router (deploy/cluster/k8s.py renders it then)."""
    return services.rollout.replicas > 1


def rollout_replicas(k8s: KubernetesSection, placement: ServicePlacement) -> list[str]:
    """host:port of each rollout replica: its StatefulSet pod's stable DNS name."""
    return [f"{host(k8s, 'rollout', i)}:{port('rollout', placement)}" for i in range(placement.replicas)]


def token_env(name: str) -> str:
    """The environment variable holding the run's token for service `name`."""
    return f"RELAYRL_{name.upper()}_TOKEN"


def server_section(name: str, placement: ServicePlacement) -> dict:
    """How a service listens in a pod: every interface, its port, /metrics, TLS and token files from its Secrets."""
    server: dict = {"address": f"0.0.0.0:{port(name, placement)}", "metrics_port": METRICS_PORT}
    tls = None
    if placement.tls is not None:
        folder = f"{SECRET_DIR}/{name}-tls"
        tls = TLSConfig(cert=f"{folder}/tls.crt", key=f"{folder}/tls.key",
                        client_ca=f"{folder}/ca.crt" if placement.tls.client_ca else None)
    server.update(server_security(placement, tls, f"{SECRET_DIR}/{name}-auth/tokens.yaml"))
    if placement.auth is None:
        server["insecure"] = True  # no tokens: any pod that can reach it may call it (docs/security.md says so)
    return server


def client_section(name: str, placement: ServicePlacement) -> dict:
    """How the driver and the trainer reach service `name` (TLS files from the clients Secret; the token: env)."""
    return client_files(placement.client, lambda field, _: f"{SECRET_DIR}/clients/{name}-{field}")


def process_configs(config: ExperimentConfig) -> dict[str, dict]:
    """File name -> content of every process's config (`config` resolved under the project volume)."""
    from deploy.rl.config import (
        Addresses,
        buffer_overrides,
        driver_config,
        merged,
        nested,
        rollout_overrides,
        trainer_config,
    )
    from deploy.rl.plan import pipeline_plan

    k8s, services = config.kubernetes, config.services
    run_dir = pathlib.Path(config.run_dir)
    plan = pipeline_plan(config, run_dir, pathlib.Path(config.model.path), run_dir / "prompts.jsonl")
    at = {name: f"{host(k8s, name)}:{port(name, getattr(services, name))}" for name in SERVERS}
    if routed(services):  # the router listens on the rollout's port under its own Service name
        at["rollout"] = f"{host(k8s, ROUTER)}:{port('rollout', services.rollout)}"
    if services.reward.replicas > 1:  # the headless Service's name resolves to every ready pod: round-robin over them
        at["reward"] = f"dns:///{at['reward']}"
    addresses = Addresses(buffer=at["buffer"], reward=at["reward"], rollout=at["rollout"])
    out = {}
    rollout = rollout_overrides(plan)
    if services.rollout.resources.gpus:  # the native engine runs on the pod's GPU unless told otherwise
        rollout.setdefault("engine.device", "cuda")
    for name, overrides in (("buffer", buffer_overrides(plan)), ("reward", plan.reward), ("rollout", rollout)):
        placement = getattr(services, name)
        out[name] = merged(nested(overrides), {"server": server_section(name, placement)})
    clients = plan.clients = {name: client_section(name, getattr(services, name)) for name in SERVERS}
    replicas = rollout_replicas(k8s, services.rollout)
    if routed(services):  # the router is a rollout server without an engine: it reaches the replicas as a client
        out[ROUTER] = {"model": rollout["model"], "router": {"replicas": replicas, "client": clients["rollout"]},
                       "server": server_section("rollout", services.rollout)}
    out["driver"] = driver_config(plan, addresses)
    trainer = services.trainer
    # trainer_config publishes to the router's replicas (receivers_from) when there are several, else to the one
    publish = {} if routed(services) else {"receivers": replicas}
    out["trainer"] = merged(trainer_config(plan, addresses), {
        "publish": {**publish, "master_addr": trainer.weight_sync.address or host(k8s, "trainer", 0),
                    "master_port": trainer.weight_sync.port},
    })
    return out


def token_args(names: list[str], prefix: str, services) -> list[str]:
    """`--set` arguments that hand a container the run's tokens for `names` (services with a client token)."""
    return [f"--set={prefix.format(name=name)}=$({token_env(name)})" for name in names if has_token(services, name)]


def has_token(services, name: str) -> bool:
    """Whether the run's clients present a token to service `name` (client.token or client.token_file)."""
    client = getattr(services, name).client
    return bool(client.token or client.token_file)
