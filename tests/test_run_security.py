"""TLS and bearer tokens in a run of an experiment file on this machine (deploy/local/security.py): each server gets its
placement's `tls` and `auth`, every client of the run reaches it with its `client` settings, and no token lands in a
file other users can read.

The end-to-end test runs `relayrl run FILE` as a user would (real processes on loopback, a CA and certificates made
here): buffer, reward (2 replicas) and rollout (2 replicas behind the router, mTLS) each with TLS and tokens. While it runs, a
plain-text client is refused (UNAVAILABLE), a TLS client without a token too (UNAUTHENTICATED), and `relayrl status
RUN_DIR` reaches every service as the run does; the run trains and ends.
"""

import json
import os
import pathlib
import stat
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from deploy.experiment.placement import local_problems, ray_problems
from deploy.experiment.schema import load_experiment
from deploy.local.security import run_security, write_secrets
from deploy.record.private_files import read_clients
from protos import buffer_pb2, buffer_pb2_grpc, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from services.client import connect_sync
from services.config import ClientConfig
from tests.pki_kit import make_pki
from tests.user_project import write_project

ROOT = pathlib.Path(__file__).resolve().parent.parent
TOKENS = {"buffer": "buffer-token-4f1c", "reward": "reward-token-9a2e", "rollout": "rollout-token-77d0"}


def secure_project(folder: pathlib.Path, run_dir: pathlib.Path, reward_replicas: int = 1, **training) -> pathlib.Path:
    """The user project of tests/user_project.py with TLS and tokens on every service, each given another way:
    the buffer's token table in a file and its client token inline, the reward's table inline, the rollout's table
    in a file, its client token in a file and mTLS (a client certificate); reward replicas are verified by the name
    their certificate carries. Paths relative to the experiment file."""
    path = write_project(folder, run_dir, **training)
    make_pki(folder / "pki")
    (folder / "tokens").mkdir()
    (folder / "tokens" / "buffer.yaml").write_text(yaml.safe_dump({TOKENS["buffer"]: "run"}))
    (folder / "tokens" / "rollout.yaml").write_text(yaml.safe_dump({TOKENS["rollout"]: "run"}))
    (folder / "tokens" / "rollout.token").write_text(TOKENS["rollout"] + "\n")
    tls = {"cert": "pki/server.pem", "key": "pki/server.key"}
    experiment = yaml.safe_load(path.read_text())
    experiment["services"] = {
        "buffer": {"tls": tls, "auth": {"tokens_file": "tokens/buffer.yaml"},
                   "client": {"ca_cert": "pki/ca.pem", "token": TOKENS["buffer"]}},
        "reward": {"replicas": reward_replicas, "tls": tls, "auth": {"tokens": {TOKENS["reward"]: "run"}},
                   "client": {"ca_cert": "pki/ca.pem", "token": TOKENS["reward"],
                              **({"server_name": "localhost"} if reward_replicas > 1 else {})}},
        "rollout": {"replicas": 2, "tls": {**tls, "client_ca": "pki/ca.pem"},
                    "auth": {"tokens_file": "tokens/rollout.yaml"},
                    "client": {"ca_cert": "pki/ca.pem", "cert": "pki/client.pem", "key": "pki/client.key",
                               "token_file": "tokens/rollout.token"}},
    }
    path.write_text(yaml.safe_dump(experiment, sort_keys=False))
    return path


def test_local_and_ray_runs_no_longer_refuse_tls_and_tokens(tmp_path):
    config = load_experiment(secure_project(tmp_path / "project", tmp_path / "run"))
    assert local_problems(config.services) == [] and ray_problems(config.services) == []


def test_reward_replicas_under_tls_need_the_name_their_certificate_carries(tmp_path):
    config = load_experiment(secure_project(tmp_path / "project", tmp_path / "run"), ["services.reward.replicas=2"])
    assert [problem.split(":")[0] for problem in local_problems(config.services)] == [
        "services.reward.client.server_name"]  # one target of two addresses: gRPC would verify no host
    named = load_experiment(secure_project(tmp_path / "named", tmp_path / "run"),
                            ["services.reward.replicas=2", "services.reward.client.server_name=localhost"])
    assert local_problems(named.services) == [] and ray_problems(named.services) == []


def test_servers_and_clients_are_told_their_files_and_tokens_stay_owner_only(tmp_path):
    folder = tmp_path / "project"
    config = load_experiment(secure_project(folder, tmp_path / "run"))
    run_dir = pathlib.Path(config.run_dir)
    servers, clients = run_security(config.services, run_dir)
    pki = folder.resolve() / "pki"
    assert servers["buffer"]["server.tls"] == {"cert": str(pki / "server.pem"), "key": str(pki / "server.key"),
                                               "client_ca": None}  # paths from the experiment file's folder
    assert servers["rollout"]["server.tls"]["client_ca"] == str(pki / "ca.pem")
    assert servers["reward"]["server.auth"]["tokens_file"] == str(run_dir / "secrets" / "reward-tokens.yaml")
    assert clients["rollout"] == {"ca_cert": str(pki / "ca.pem"), "cert": str(pki / "client.pem"),
                                  "key": str(pki / "client.key"),
                                  "token_file": str(run_dir / "secrets" / "rollout.token")}
    write_secrets(config.services, run_dir)
    secrets = run_dir / "secrets"
    assert stat.S_IMODE(secrets.stat().st_mode) == 0o700
    for file in secrets.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    assert yaml.safe_load((secrets / "reward-tokens.yaml").read_text()) == {TOKENS["reward"]: "run"}
    assert yaml.safe_load((secrets / "buffer-tokens.yaml").read_text()) == {TOKENS["buffer"]: "run"}
    assert {name: (secrets / f"{name}.token").read_text() for name in TOKENS} == TOKENS
    recorded = (run_dir / "clients.json").read_text()
    assert not any(token in recorded for token in TOKENS.values())
    assert read_clients(run_dir)["buffer"].token_file == str(secrets / "buffer.token")


def _code(call) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return None


def _refusals(kind: str, address: str, pki: pathlib.Path) -> dict[str, grpc.StatusCode | None]:
    """How `kind` at `address` answers one of its RPCs from a plain-text client and from a TLS client (with the
    client certificate) that has no token."""
    calls = {
        "buffer": lambda ch: buffer_pb2_grpc.BufferStub(ch).Stats(buffer_pb2.StatsRequest(), timeout=10),
        "reward": lambda ch: reward_pb2_grpc.RewardStub(ch).Score(reward_pb2.ScoreRequest(), timeout=10),
        "rollout": lambda ch: rollout_pb2_grpc.RolloutStub(ch).GetWeightVersion(
            rollout_pb2.GetWeightVersionRequest(), timeout=10),
    }
    no_token = ClientConfig(ca_cert=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key"))
    out = {}
    for name, client in (("plain text", None), ("no token", no_token)):
        with connect_sync(address, client) as channel:
            out[name] = _code(lambda: calls[kind](channel))
    return out


def _command_lines_holding_a_token() -> list[str]:
    """Command lines of this machine's processes (any user may read them) that hold one of the run's tokens."""
    found = []
    for cmdline in pathlib.Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes()
        except OSError:  # the process ended meanwhile
            continue
        found += [f"{cmdline.parent.name}: {name}" for name, token in TOKENS.items() if token.encode() in text]
    return found


def _world_readable_files_holding_a_token(run_dir: pathlib.Path) -> list[str]:
    found = []
    for path in run_dir.rglob("*"):
        if path.is_file() and path.stat().st_mode & stat.S_IROTH:
            text = path.read_bytes()
            found += [f"{path}: {name}" for name, token in TOKENS.items() if token.encode() in text]
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_run_with_tls_and_tokens_on_every_service_trains_and_refuses_other_callers(tmp_path):
    folder, run_dir = tmp_path / "project", tmp_path / "run"
    path = secure_project(folder, run_dir, reward_replicas=2, time_budget_s=300, max_steps=2)  # ends after 2 steps
    pki = folder / "pki"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log = tmp_path / "run.log"
    with open(log, "wb") as out:
        run = subprocess.Popen([sys.executable, "-m", "deploy.cli", "run", str(path)], stdout=out,
                               stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        registry = run_dir / "services.json"
        deadline = time.monotonic() + 300
        services: dict = {}
        while not {"buffer", "reward-1", "reward-2", "rollout", "rollout-1", "rollout-2"} <= services.keys():
            assert run.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run's services did not all start"
            time.sleep(0.5)
            services = json.loads(registry.read_text()) if registry.exists() else {}
        for name, entry in services.items():
            refused = _refusals(entry["kind"], entry["address"], pki)
            assert refused == {"plain text": grpc.StatusCode.UNAVAILABLE,
                               "no token": grpc.StatusCode.UNAUTHENTICATED}, (name, refused)
        status = subprocess.run([sys.executable, "-m", "deploy.cli", "status", str(run_dir), "--json",
                                 "--interval", "0.5"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                                check=False)
        assert status.returncode == 0, status.stdout + status.stderr  # every service SERVING, reached with TLS
        assert {row["name"] for row in json.loads(status.stdout)["services"]} >= {"buffer", "reward-1", "rollout"}
        while run.poll() is None and not (run_dir / "driver_stats.jsonl").exists():  # the driver and trainer run
            time.sleep(0.5)
        assert _command_lines_holding_a_token() == []
        assert run.wait(timeout=600) == 0, log.read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.terminate()
            run.wait(60)
    steps = [json.loads(line) for line in (run_dir / "trainer_metrics.jsonl").read_text().splitlines()]
    assert steps and steps[-1]["step"] >= 1
    assert (run_dir / "summary.json").is_file()
    assert _world_readable_files_holding_a_token(run_dir) == []
