"""TLS and bearer tokens of a run on this machine or on Ray (`relayrl run FILE [--ray ADDRESS]`): what each server
and each client of the run is told, from each service's `tls`, `auth` and `client` (deploy/experiment/placement.py; paths
resolved from the experiment file's folder by deploy/experiment/schema.py).

    each server     server.tls (the experiment's cert, key, client_ca) and server.auth (its token table, allow,
                    open_methods); the router in front of rollout replicas serves as the rollout does
    each client     the service's `client` (ca_cert, cert, key, server_name, the token as a token_file): the driver,
                    the trainer (buffer, weight publish), the evaluation, the router to its replicas, the rollout's
                    buffer client when it has one, the launcher's and the supervisor's health checks, and
                    `relayrl status RUN_DIR` / `relayrl deploy scale` (through the run's process)

No token goes into a world-readable file nor onto a command line (where `ps` shows it to every user of the machine):

    RUN_DIR/secrets/            owner-only (0700; each file 0600)
        SERVICE-tokens.yaml     the server's token -> role table: auth.tokens and auth.tokens_file merged
        SERVICE.token           the token the run's clients present to SERVICE (client.token)
    RUN_DIR/clients.json        by service kind, the ClientConfig fields its clients use: paths, never a token

`relayrl deploy k8s` states the same sections with its Secrets' mount paths (deploy/cluster/k8s_configs.py).
"""

import json
import pathlib
from collections.abc import Callable

import yaml

from deploy.experiment.placement import SERVERS, ServicePlacement, ServicesSection
from deploy.record.private_files import CLIENTS_FILE, write_private
from services.client import bearer_token
from services.config import AuthConfig, ClientConfig, TLSConfig

SECRETS_DIR = "secrets"


def server_security(placement: ServicePlacement, tls: TLSConfig | None, tokens_file: str | None) -> dict:
    """The `server` settings that secure a service: its TLS files (`tls`: where its process finds them) and its
    auth, with its token table at `tokens_file`; {} for a service with neither."""
    section: dict = {}
    if placement.tls is not None:
        section["tls"] = tls.model_dump()
    if placement.auth is not None:
        section["auth"] = {"tokens_file": tokens_file, "allow": placement.auth.allow,
                           "open_methods": placement.auth.open_methods}
    return section


def client_files(client: ClientConfig, at: Callable[[str, str], str]) -> dict:
    """A client's TLS files (`at(field, path)`: where its process finds each) and server_name; never its token."""
    out = {field: at(field, path) for field in ("ca_cert", "cert", "key") if (path := getattr(client, field))}
    if client.server_name:
        out["server_name"] = client.server_name
    return out


def tokens_of(auth: AuthConfig) -> dict[str, str]:
    """A server's token -> role table: auth.tokens with the entries of auth.tokens_file laid over them."""
    tokens = dict(auth.tokens)
    if auth.tokens_file:
        tokens.update(yaml.safe_load(pathlib.Path(auth.tokens_file).read_text()) or {})
    return {str(token): str(role) for token, role in tokens.items()}


def run_security(services: ServicesSection, run_dir: pathlib.Path) -> tuple[dict[str, dict], dict[str, dict]]:
    """(`--set` overrides that secure each server, ClientConfig fields of each service's clients) of a run in
    `run_dir`, by service name; paths only (write_secrets writes the files they name)."""
    secrets = run_dir / SECRETS_DIR
    servers, clients = {}, {}
    for name in SERVERS:
        placement: ServicePlacement = getattr(services, name)
        section = server_security(placement, placement.tls, str(secrets / f"{name}-tokens.yaml"))
        servers[name] = {f"server.{key}": value for key, value in section.items()}
        client = client_files(placement.client, lambda _, path: path)
        if placement.client.token or placement.client.token_file:
            client["token_file"] = str(secrets / f"{name}.token")
        clients[name] = client
    return servers, clients


def write_secrets(services: ServicesSection, run_dir: pathlib.Path) -> None:
    """The token files run_security names (owner-only) and RUN_DIR/clients.json (for `relayrl status RUN_DIR`)."""
    secrets = run_dir / SECRETS_DIR
    _, clients = run_security(services, run_dir)
    for name in SERVERS:
        placement: ServicePlacement = getattr(services, name)
        if placement.auth is not None:
            write_private(secrets / f"{name}-tokens.yaml", yaml.safe_dump(tokens_of(placement.auth)))
        token = bearer_token(placement.client)
        if token:
            write_private(secrets / f"{name}.token", token)
    (run_dir / CLIENTS_FILE).write_text(json.dumps(clients, indent=2))


def secure(plan, services: ServicesSection) -> None:
    """Lay a run's TLS and tokens over `plan` (deploy.rl.config.Pipeline): each server's overrides and every client's
    settings; the files they name are written in plan.run_dir."""
    servers, plan.clients = run_security(services, plan.run_dir)
    write_secrets(services, plan.run_dir)
    for name in SERVERS:
        getattr(plan, name).update(servers[name])
    if plan.rollout.get("buffer") and plan.clients["buffer"]:  # sessions submit to it (services.rollout.settings)
        plan.rollout.setdefault("buffer_client", plan.clients["buffer"])
