"""`relayrl deploy k8s FILE`: an experiment placed on node groups, as Kubernetes manifests.

    ConfigMap    {name}-config: the experiment (paths under the project volume) and each process's config file
    Secret       {name}-SERVICE-tls, {name}-SERVICE-auth (a server's TLS files and tokens), {name}-clients (what
                 the driver and trainer present): read from the files the experiment names
    buffer       StatefulSet of one; reward: Deployment; rollout: StatefulSet (stable pod names: the trainer
                 publishes weights to each replica); each with a headless Service, gRPC health probes, resources.
                 The reward's Service name resolves to every ready reward pod: the driver's channel balances its
                 Score calls round-robin over them (services/client.py), as a local run's over reward-1..N
    router       with rollout replicas > 1: a Deployment of one `relayrl serve rollout` routing over the replicas'
                 stable names (rollout/router/router.py) on the rollout's group, and its Service; the driver generates
                 through it and the trainer publishes to the replicas it lists
    trainer      indexed Job of `nodes` pods, each `torchrun --nproc-per-node P --node-rank INDEX`; pod 0 holds
                 global rank 0, so it hosts torchrun's rendezvous and the weight broadcast's (headless Service)
    driver       Deployment of one: writes the prompts (init container), then generates, scores and fills the buffer

Pods land on their group's nodes by its selector (a nodeSelector) or hosts (node affinity on the host name). The
held-out evaluation, the SFT warm-up and the final export of a local run are not rendered.
"""

import base64
import pathlib
import sys

import yaml

from deploy.cluster.k8s_configs import (
    CONFIG_DIR,
    METRICS_PORT,
    ROUTER,
    SECRET_DIR,
    has_token,
    host,
    object_name,
    port,
    process_configs,
    routed,
    token_args,
    token_env,
)
from deploy.experiment.placement import SERVERS, NodeGroup, Resources, ServicePlacement
from deploy.experiment.schema import ExperimentConfig

WORKLOADS = {"buffer": "StatefulSet", "reward": "Deployment", "rollout": "StatefulSet"}


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's files) as literal blocks, so a rendered manifest reads like the files."""

    def ignore_aliases(self, data) -> bool:  # a dict used twice (a probe) is written out twice, not as an anchor
        return True


_Dumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def dump(obj: dict | list[dict]) -> str:
    """One object as YAML, or several as one multi-document stream."""
    if isinstance(obj, list):
        return yaml.dump_all(obj, Dumper=_Dumper, sort_keys=False)
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False)


class RenderError(ValueError):
    """The experiment cannot be rendered as it is; the message names the field."""


def _labels(config: ExperimentConfig, component: str) -> dict:
    return {"app.kubernetes.io/name": "relayrl", "app.kubernetes.io/instance": config.kubernetes.name,
            "app.kubernetes.io/component": component}


def _meta(config: ExperimentConfig, component: str, name: str | None = None) -> dict:
    return {"name": name or object_name(config.kubernetes, component), "namespace": config.kubernetes.namespace,
            "labels": _labels(config, component)}


def _resources(resources: Resources) -> dict:
    requests, limits = {}, {}
    if resources.cpu:
        requests["cpu"] = f"{resources.cpu:g}"
    if resources.memory:
        requests["memory"] = limits["memory"] = resources.memory
    if resources.gpus:
        limits["nvidia.com/gpu"] = resources.gpus  # extended resources are set as limits (the device plugin's)
    return {key: value for key, value in (("requests", requests), ("limits", limits)) if value}


def _placement(group: NodeGroup | None) -> dict:
    """nodeSelector from the group's labels; node affinity on the host name from its hosts."""
    spec: dict = {}
    if group is not None and group.selector:
        spec["nodeSelector"] = dict(group.selector)
    if group is not None and group.hosts:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "In", "values": group.hosts}]}]}}}
    return spec


def _volumes(config: ExperimentConfig, secrets: list[str]) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts): the ConfigMap, the project claim, and the named Secrets under SECRET_DIR."""
    k8s = config.kubernetes
    volumes = [{"name": "config", "configMap": {"name": object_name(k8s, "config")}},
               {"name": "project", "persistentVolumeClaim": {"claimName": k8s.project_claim}}]
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              {"name": "project", "mountPath": k8s.project_path}]
    for secret in secrets:
        volumes.append({"name": secret, "secret": {"secretName": object_name(k8s, secret)}})
        mounts.append({"name": secret, "mountPath": f"{SECRET_DIR}/{secret}", "readOnly": True})
    return volumes, mounts


def _token_env(config: ExperimentConfig, names: list[str]) -> list[dict]:
    return [{"name": token_env(name), "valueFrom": {"secretKeyRef": {
        "name": object_name(config.kubernetes, "clients"), "key": f"{name}-token"}}}
        for name in names if has_token(config.services, name)]


def _container(config: ExperimentConfig, name: str, command: list[str], mounts: list[dict], **extra) -> dict:
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}, {"name": "HF_HUB_OFFLINE", "value": "1"},
           *extra.pop("env", [])]
    return {"name": name, "image": config.kubernetes.image, "imagePullPolicy": config.kubernetes.image_pull_policy,
            "command": command, "env": env, "volumeMounts": mounts, **extra}


def _probes(placement: ServicePlacement, grpc_port: int) -> dict:
    """grpc.health.v1 probes (every relayrl server serves it, open to callers without a token). Kubernetes' gRPC
    probe speaks no TLS: a TLS service is probed by a TCP connect instead."""
    probe = {"grpc": {"port": grpc_port}} if placement.tls is None else {"tcpSocket": {"port": grpc_port}}
    return {"startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 60},  # model loads: up to 10 min
            "readinessProbe": {**probe, "periodSeconds": 5},
            "livenessProbe": {**probe, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6}}


def _service_workload(config: ExperimentConfig, name: str, groups: dict[str, NodeGroup], env: dict) -> dict:
    placement: ServicePlacement = getattr(config.services, name)
    grpc_port = port(name, placement)
    secrets = [f"{name}-{kind}" for kind in ("tls", "auth") if getattr(placement, kind) is not None]
    volumes, mounts = _volumes(config, secrets)
    container = _container(
        config, name, ["relayrl", "serve", name, "--config", f"{CONFIG_DIR}/{name}.yaml"], mounts,
        env=[{"name": key, "value": value} for key, value in env.items()],
        ports=[{"name": "grpc", "containerPort": grpc_port}, {"name": "metrics", "containerPort": METRICS_PORT}],
        resources=_resources(placement.resources), **_probes(placement, grpc_port))
    group = groups.get(placement.group) if placement.group else None
    pod = {"metadata": {"labels": _labels(config, name)},
           "spec": {**_placement(group), "containers": [container], "volumes": volumes}}
    spec = {"replicas": placement.replicas, "selector": {"matchLabels": _labels(config, name)}, "template": pod}
    if WORKLOADS[name] == "StatefulSet":
        spec = {"serviceName": object_name(config.kubernetes, name), "podManagementPolicy": "Parallel", **spec}
    return {"apiVersion": "apps/v1", "kind": WORKLOADS[name], "metadata": _meta(config, name), "spec": spec}


def _router(config: ExperimentConfig, groups: dict[str, NodeGroup]) -> dict:
    """The rollout router: one pod on the rollout's group, serving as the rollout does (its port, TLS and tokens),
    reaching the replicas as the run's clients do (the clients Secret, the rollout token). It holds no model and
    asks for no GPU; a restarted router finds the replicas again from its config."""
    placement = config.services.rollout
    grpc_port = port("rollout", placement)
    secrets = [f"rollout-{kind}" for kind in ("tls", "auth") if getattr(placement, kind) is not None]
    volumes, mounts = _volumes(config, secrets + (["clients"] if _has_clients(config) else []))
    container = _container(
        config, "router", ["relayrl", "serve", "rollout", "--config", f"{CONFIG_DIR}/{ROUTER}.yaml",
                           *token_args(["rollout"], "router.client.token", config.services)], mounts,
        env=_token_env(config, ["rollout"]),
        ports=[{"name": "grpc", "containerPort": grpc_port}, {"name": "metrics", "containerPort": METRICS_PORT}],
        **_probes(placement, grpc_port))
    group = groups.get(placement.group) if placement.group else None
    pod = {"metadata": {"labels": _labels(config, ROUTER)},
           "spec": {**_placement(group), "containers": [container], "volumes": volumes}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(config, ROUTER), "spec": {
        "replicas": 1, "selector": {"matchLabels": _labels(config, ROUTER)}, "template": pod}}


def _headless(config: ExperimentConfig, component: str, ports: list[tuple[str, int]], ready_only: bool) -> dict:
    spec = {"clusterIP": "None", "selector": _labels(config, component),
            "ports": [{"name": name, "port": number, "targetPort": number} for name, number in ports]}
    if not ready_only:
        spec["publishNotReadyAddresses"] = True  # torchrun's pods find each other before any is ready
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(config, component), "spec": spec}


def _trainer(config: ExperimentConfig, groups: dict[str, NodeGroup]) -> dict:
    trainer, k8s = config.services.trainer, config.kubernetes
    clients = ["clients"] if _has_clients(config) else []
    volumes, mounts = _volumes(config, clients)
    command = ["torchrun", f"--nnodes={trainer.nodes}", f"--nproc-per-node={trainer.procs_per_node}",
               "--node-rank=$(JOB_COMPLETION_INDEX)", f"--master-addr={host(k8s, 'trainer', 0)}",
               f"--master-port={trainer.rendezvous_port}", "-m", "trainer", "--config", f"{CONFIG_DIR}/trainer.yaml",
               *token_args(["buffer"], "buffer.client.token", config.services),
               *token_args(["rollout"], "publish.client.token", config.services)]
    ports = [{"name": "rendezvous", "containerPort": trainer.rendezvous_port}]
    if trainer.weight_sync.port:
        ports.append({"name": "weights", "containerPort": trainer.weight_sync.port})
    container = _container(config, "trainer", command, mounts, env=_token_env(config, ["buffer", "rollout"]),
                           ports=ports, resources=_resources(trainer.resources))
    group = groups.get(trainer.group) if trainer.group else None
    pod = {"metadata": {"labels": _labels(config, "trainer")},
           "spec": {**_placement(group), "subdomain": object_name(k8s, "trainer"), "restartPolicy": "OnFailure",
                    "containers": [container], "volumes": volumes}}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(config, "trainer"), "spec": {
        "completionMode": "Indexed", "completions": trainer.nodes, "parallelism": trainer.nodes, "backoffLimit": 3,
        "template": pod}}


def _driver(config: ExperimentConfig, groups: dict[str, NodeGroup]) -> dict:
    """The driver, on the buffer's group; its init container writes the prompt file the driver reads."""
    volumes, mounts = _volumes(config, ["clients"] if _has_clients(config) else [])
    prompts = _container(config, "prompts", ["python", "-m", "deploy.experiment.data",
                                             f"{CONFIG_DIR}/experiment.yaml"], mounts)
    names = list(SERVERS)
    driver = _container(config, "driver", ["python", "-m", "rollout.driver", "--config", f"{CONFIG_DIR}/driver.yaml",
                                           *token_args(names, "clients.{name}.token", config.services)],
                        mounts, env=_token_env(config, names))
    group = groups.get(config.services.buffer.group) if config.services.buffer.group else None
    pod = {"metadata": {"labels": _labels(config, "driver")},
           "spec": {**_placement(group), "initContainers": [prompts], "containers": [driver], "volumes": volumes}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(config, "driver"), "spec": {
        "replicas": 1, "strategy": {"type": "Recreate"},  # never two drivers feeding one buffer
        "selector": {"matchLabels": _labels(config, "driver")}, "template": pod}}


def _read(folder: pathlib.Path, path: str, field: str) -> bytes:
    file = folder / pathlib.Path(path).expanduser()
    if not file.is_file():
        raise RenderError(f"{field}: no file {file}")
    return file.read_bytes()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _has_clients(config: ExperimentConfig) -> bool:
    """Whether the run's clients present anything (a token, TLS files) to some service: the clients Secret."""
    clients = [getattr(config.services, name).client for name in SERVERS]
    return any(client.token or client.token_file or client.ca_cert or client.cert or client.key for client in clients)


def _secrets(config: ExperimentConfig, folder: pathlib.Path) -> list[dict]:
    """The TLS files and tokens the experiment names, read now from `folder` (the experiment file's)."""
    out, clients = [], {}
    for name in SERVERS:
        placement: ServicePlacement = getattr(config.services, name)
        field = f"services.{name}"
        if placement.tls is not None:
            files = {"tls.crt": ("cert", placement.tls.cert), "tls.key": ("key", placement.tls.key),
                     "ca.crt": ("client_ca", placement.tls.client_ca)}
            data = {key: _b64(_read(folder, path, f"{field}.tls.{attr}")) for key, (attr, path) in files.items()
                    if path}
            out.append({"apiVersion": "v1", "kind": "Secret", "metadata": _meta(config, name, object_name(
                config.kubernetes, f"{name}-tls")), "type": "kubernetes.io/tls", "data": data})
        if placement.auth is not None:
            tokens = dict(placement.auth.tokens)
            if placement.auth.tokens_file:
                tokens.update(yaml.safe_load(_read(folder, placement.auth.tokens_file, f"{field}.auth.tokens_file"))
                              or {})
            data = {"tokens.yaml": _b64(yaml.safe_dump(tokens).encode())}
            out.append({"apiVersion": "v1", "kind": "Secret", "metadata": _meta(config, name, object_name(
                config.kubernetes, f"{name}-auth")), "type": "Opaque", "data": data})
        client = placement.client
        for attr in ("ca_cert", "cert", "key"):
            if getattr(client, attr):
                clients[f"{name}-{attr}"] = _b64(_read(folder, getattr(client, attr), f"{field}.client.{attr}"))
        if client.token or client.token_file:
            token = client.token or _read(folder, client.token_file, f"{field}.client.token_file").decode().strip()
            clients[f"{name}-token"] = _b64(token.encode())
    if clients:
        out.append({"apiVersion": "v1", "kind": "Secret", "metadata": _meta(config, "clients"), "type": "Opaque",
                    "data": clients})
    return out


def _in_cluster(config: ExperimentConfig) -> ExperimentConfig:
    """`config` with its relative paths under the project volume, after the checks rendering needs."""
    k8s = config.kubernetes
    for field, value in (("kubernetes.image", k8s.image), ("kubernetes.project_claim", k8s.project_claim)):
        if not value:
            raise RenderError(f"{field}: not set (the manifests need it: see deploy/experiment/placement.py)")
    if config.sft.steps:
        raise RenderError(f"sft.steps: {config.sft.steps}, but the manifests run no SFT warm-up: run it first and "
                          "set model.path to its output, or sft.steps: 0")
    if pathlib.PurePosixPath(config.run_dir).is_absolute():
        raise RenderError(f"run_dir: {config.run_dir} is absolute; on Kubernetes it must be relative (inside "
                          "the project volume, where every pod finds it)")
    return config.resolved(pathlib.Path(k8s.project_path))


def render(config: ExperimentConfig, folder: pathlib.Path) -> list[dict]:
    """Every object, in the order to apply them. `config` as loaded (paths not yet resolved), `folder` the
    experiment file's (TLS files and token files are read from it)."""
    if config.model.tiny is not None or config.env is not None:
        raise RenderError(f"{'model.tiny' if config.model.tiny is not None else 'env'}: runs on one machine "
                          "(`relayrl run`); a cluster run needs model.path (a folder on the project volume) and data")
    if config.algorithm.name == "dpo":
        raise RenderError("algorithm dpo: an offline run trains in one process (`relayrl run`), no services to deploy")
    if config.teacher is not None or config.teachers:
        raise RenderError("teacher / teachers: distillation's teacher services run on one machine (`relayrl run`); "
                          "not yet rendered for Kubernetes")
    secrets = _secrets(config, folder)
    config = _in_cluster(config)
    groups = {group.name: group for group in config.groups}
    experiment = config.model_dump(mode="json", exclude_defaults=True)
    for name in SERVERS:  # tokens travel in Secrets, never in the ConfigMap
        service = experiment.get("services", {}).get(name, {})
        if service.get("auth", {}).get("tokens"):
            service["auth"]["tokens"] = {}
        if service.get("client", {}).get("token"):
            service["client"]["token"] = "in-secret"
    data = {"experiment.yaml": yaml.safe_dump(experiment, sort_keys=False)}
    data.update({f"{name}.yaml": yaml.safe_dump(body, sort_keys=False)
                 for name, body in process_configs(config).items()})
    objects = [{"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(config, "config"), "data": data},
               *secrets]
    env = {"reward": {"PYTHONPATH": ":".join(config.reward.python_path)}}
    for name in SERVERS:
        ports = [("grpc", port(name, getattr(config.services, name))), ("metrics", METRICS_PORT)]
        objects += [_headless(config, name, ports, ready_only=True),
                    _service_workload(config, name, groups, env.get(name, {}))]
        if name == "rollout" and routed(config.services):
            objects += [_headless(config, ROUTER, ports, ready_only=True), _router(config, groups)]
    trainer = config.services.trainer
    trainer_ports = [("rendezvous", trainer.rendezvous_port)]
    if trainer.weight_sync.port:
        trainer_ports.append(("weights", trainer.weight_sync.port))
    objects += [_headless(config, "trainer", trainer_ports, ready_only=False), _trainer(config, groups),
                _driver(config, groups)]
    return objects


def file_name(index: int, obj: dict) -> str:
    return f"{index:02d}-{obj['kind'].lower()}-{obj['metadata']['name']}.yaml"


def main(path: str, overrides: list[str] | None = None, out: str | None = None) -> int:
    from services.config import ConfigError, load_config

    try:
        config = load_config(ExperimentConfig, path, overrides or [])
        objects = render(config, pathlib.Path(path).resolve().parent)
    except (ConfigError, RenderError, FileNotFoundError) as exc:
        print(f"relayrl deploy k8s: {exc}", file=sys.stderr)
        return 2
    if out is None:
        print(dump(objects), end="")
        return 0
    folder = pathlib.Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("[0-9][0-9]-*.yaml"):
        stale.unlink()
    for index, obj in enumerate(objects):
        (folder / file_name(index, obj)).write_text(dump(obj))
    print(f"{len(objects)} objects -> {folder} (kubectl apply -f {folder})")
    return 0
