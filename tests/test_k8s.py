"""`relayrl deploy k8s FILE`: manifests valid against the Kubernetes API schemas (kubernetes-validate, strict: no
unknown fields), pinned by golden files, and each process's config file valid for the process that reads it.

The golden files are the shipped example's rendering. After a deliberate change, regenerate them with
    python -m deploy.cli deploy k8s examples/cluster/experiment.yaml --out tests/golden/k8s_cluster
and review the diff.
"""

import base64
import copy
import pathlib
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from deploy.cluster.k8s import RenderError, render
from deploy.experiment.schema import ExperimentConfig
from services.config import load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cluster" / "experiment.yaml"
GOLDEN = ROOT / "tests" / "golden" / "k8s_cluster"
VERSIONS = ("1.29.0", "1.37.0")  # the oldest Kubernetes with every field used here that we check, and the newest


def _render_cli(out: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deploy.cli", "deploy", "k8s", *args, "--out", str(out)],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)


def _validate(obj: dict) -> None:
    for version in VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def _by_kind(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(obj["kind"], obj["metadata"]["name"]): obj for obj in objects}


def test_the_example_renders_valid_manifests_equal_to_the_golden_files(tmp_path):
    done = _render_cli(tmp_path / "out", str(EXAMPLE))
    assert done.returncode == 0, done.stderr
    rendered = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert rendered == sorted(p.name for p in GOLDEN.iterdir())
    for name in rendered:
        text = (tmp_path / "out" / name).read_text()
        assert text == (GOLDEN / name).read_text(), f"{name} differs from the golden file (see this file's docstring)"
        _validate(yaml.safe_load(text))


def test_a_broken_manifest_fails_the_validator():
    rollout = yaml.safe_load((GOLDEN / "06-statefulset-math-grpo-rollout.yaml").read_text())
    _validate(rollout)
    container = ["spec", "template", "spec", "containers", 0]
    for path, value in [(["spec", "replicas"], "four"), ([*container, "ports", 0, "containerPort"], "grpc"),
                        ([*container, "readinessProbe", "grpc", "port"], "50053"),
                        ([*container, "resources", "limit"], {"cpu": "1"})]:
        broken = copy.deepcopy(rollout)
        node = broken
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value
        with pytest.raises(kubernetes_validate.ValidationError):
            _validate(broken)


def _example(*changes: str) -> ExperimentConfig:
    """The shipped example as loaded (paths not resolved), with `--set` style changes."""
    return load_config(ExperimentConfig, EXAMPLE, changes)


def test_each_process_is_placed_probed_and_configured_as_its_group_says():
    objects = _by_kind(render(_example(), EXAMPLE.parent))
    rollout = objects["StatefulSet", "math-grpo-rollout"]["spec"]
    pod = rollout["template"]["spec"]
    container = pod["containers"][0]
    assert rollout["replicas"] == 8 and pod["nodeSelector"] == {"relayrl.dev/pool": "inference"}
    assert container["command"] == ["relayrl", "serve", "rollout", "--config", "/etc/relayrl/rollout.yaml"]
    assert container["readinessProbe"]["grpc"] == {"port": 50053} and "grpc" in container["livenessProbe"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert objects["Service", "math-grpo-rollout"]["spec"]["clusterIP"] == "None"
    assert objects["StatefulSet", "math-grpo-buffer"]["spec"]["replicas"] == 1
    assert objects["Deployment", "math-grpo-reward"]["spec"]["replicas"] == 2

    job = objects["Job", "math-grpo-trainer"]["spec"]
    assert job["completionMode"] == "Indexed" and job["completions"] == job["parallelism"] == 2
    command = job["template"]["spec"]["containers"][0]["command"]
    assert command[:6] == ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--node-rank=$(JOB_COMPLETION_INDEX)",
                           "--master-addr=math-grpo-trainer-0.math-grpo-trainer.rl.svc.cluster.local",
                           "--master-port=29400"]
    assert job["template"]["spec"]["subdomain"] == "math-grpo-trainer"

    # Every config file is valid for the process that reads it, and addresses name the stable DNS names.
    files = {name: yaml.safe_load(text) for name, text in objects["ConfigMap", "math-grpo-config"]["data"].items()}
    from reward.service import Config as RewardConfig
    from rollout.driver.driver import DriverConfig
    from rollout.main import Config as RolloutConfig
    from services.buffer.service import Config as BufferConfig
    from trainer.config import TrainerConfig

    for name, cls in [("buffer", BufferConfig), ("reward", RewardConfig), ("rollout", RolloutConfig),
                      ("rollout-router", RolloutConfig), ("driver", DriverConfig), ("trainer", TrainerConfig),
                      ("experiment", ExperimentConfig)]:
        cls.model_validate(files[f"{name}.yaml"])
    # 8 replicas: the driver generates through the router, which routes over the replicas' stable pod names; the
    # trainer publishes to the replicas the router lists.
    replicas = [f"math-grpo-rollout-{i}.math-grpo-rollout.rl.svc.cluster.local:50053" for i in range(8)]
    router = "math-grpo-rollout-router.rl.svc.cluster.local:50053"
    assert files["rollout-router.yaml"]["router"]["replicas"] == replicas
    assert files["driver.yaml"]["rollout"] == router
    trainer = files["trainer.yaml"]
    assert trainer["publish"]["receivers_from"] == router and "receivers" not in trainer["publish"]
    router_pod = objects["Deployment", "math-grpo-rollout-router"]["spec"]["template"]["spec"]
    assert router_pod["nodeSelector"] == {"relayrl.dev/pool": "inference"} and "resources" not in router_pod[
        "containers"][0]
    assert router_pod["containers"][0]["command"][-1] == "/etc/relayrl/rollout-router.yaml"
    assert objects["Service", "math-grpo-rollout-router"]["spec"]["ports"][0]["port"] == 50053
    assert trainer["publish"]["master_addr"] == "math-grpo-trainer-0.math-grpo-trainer.rl.svc.cluster.local"
    assert trainer["publish"]["master_port"] == 29500 and trainer["publish"]["backend"] == "nccl"
    TrainerConfig.model_validate(trainer).batch.check_divisible(16)  # 2 nodes x 8 processes share each step
    assert files["driver.yaml"]["buffer"] == "math-grpo-buffer.rl.svc.cluster.local:50051"
    assert files["rollout.yaml"]["engine"] == {"seed": 0, "dtype": "bfloat16", "device": "cuda"}
    assert files["buffer.yaml"]["data_dir"] == "/project/runs/cluster/buffer"


def test_one_rollout_replica_has_no_router():
    objects = _by_kind(render(_example("services.rollout.replicas=1"), EXAMPLE.parent))
    assert not [key for key in objects if "router" in key[1]]
    files = {name: yaml.safe_load(text) for name, text in objects["ConfigMap", "math-grpo-config"]["data"].items()}
    assert "rollout-router.yaml" not in files
    one = "math-grpo-rollout-0.math-grpo-rollout.rl.svc.cluster.local:50053"
    assert files["trainer.yaml"]["publish"]["receivers"] == [one]
    assert files["driver.yaml"]["rollout"] == "math-grpo-rollout.rl.svc.cluster.local:50053"


def test_the_rendered_router_starts_and_lists_the_replicas_stable_names(tmp_path):
    """The router's config file as rendered starts a real `relayrl serve rollout` router (on loopback here), which
    lists the StatefulSet's stable names as its replicas (not reachable from this machine: not alive, not routed)."""
    import grpc

    from deploy.local.service_process import start_service
    from protos import router_pb2, router_pb2_grpc

    objects = _by_kind(render(_example("services.rollout.replicas=2"), EXAMPLE.parent))
    config = tmp_path / "rollout-router.yaml"
    config.write_text(objects["ConfigMap", "math-grpo-config"]["data"]["rollout-router.yaml"])
    router = start_service("rollout", {"server.address": "127.0.0.1:0", "server.metrics_port": 0},
                           config_path=config, log_dir=tmp_path / "logs")
    try:
        with grpc.insecure_channel(router.address) as channel:
            listed = router_pb2_grpc.ReplicasStub(channel).ListReplicas(router_pb2.ListReplicasRequest(), timeout=30)
    finally:
        router.stop()
    assert [info.address for info in listed.replicas] == [
        f"math-grpo-rollout-{i}.math-grpo-rollout.rl.svc.cluster.local:50053" for i in range(2)]
    assert not any(info.alive for info in listed.replicas)


def test_hosts_become_node_affinity():
    config = _example("groups=[{name: training, hosts: [t1, t2]}, {name: inference}, {name: cpu}]")
    objects = _by_kind(render(config, EXAMPLE.parent))
    pod = objects["Job", "math-grpo-trainer"]["spec"]["template"]["spec"]
    term = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0]
    assert term["matchExpressions"] == [{"key": "kubernetes.io/hostname", "operator": "In", "values": ["t1", "t2"]}]
    assert "nodeSelector" not in pod
    for obj in objects.values():
        _validate(obj)


def test_tls_files_and_tokens_travel_in_secrets(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (folder / name).write_text(f"-----BEGIN {name}-----\n")
    (folder / "tokens.yaml").write_text("driver-secret: driver\ntrainer-secret: trainer\n")
    data = yaml.safe_load(EXAMPLE.read_text())
    data["services"]["buffer"].update(
        tls={"cert": "cert.pem", "key": "key.pem", "client_ca": "ca.pem"},
        auth={"tokens_file": "tokens.yaml", "allow": {"relayrl.buffer.v1.Buffer": ["driver", "trainer"]}},
        client={"token": "trainer-secret", "ca_cert": "ca.pem", "cert": "cert.pem", "key": "key.pem"})
    (folder / "experiment.yaml").write_text(yaml.safe_dump(data))
    done = _render_cli(tmp_path / "out", str(folder / "experiment.yaml"))
    assert done.returncode == 0, done.stderr
    objects = _by_kind([yaml.safe_load(p.read_text()) for p in sorted((tmp_path / "out").iterdir())])
    for obj in objects.values():
        _validate(obj)

    def decoded(secret: str, key: str) -> str:
        return base64.b64decode(objects["Secret", secret]["data"][key]).decode()

    assert decoded("math-grpo-buffer-tls", "tls.crt") == "-----BEGIN cert.pem-----\n"
    assert decoded("math-grpo-buffer-tls", "ca.crt") == "-----BEGIN ca.pem-----\n"
    assert yaml.safe_load(decoded("math-grpo-buffer-auth", "tokens.yaml")) == {"driver-secret": "driver",
                                                                               "trainer-secret": "trainer"}
    assert decoded("math-grpo-clients", "buffer-token") == "trainer-secret"
    config_map = objects["ConfigMap", "math-grpo-config"]["data"]
    assert not any("secret" in text.replace("in-secret", "").replace("/secrets/", "") for text in config_map.values())
    server = yaml.safe_load(config_map["buffer.yaml"])["server"]
    assert server["tls"]["cert"] == "/etc/relayrl/secrets/buffer-tls/tls.crt" and "insecure" not in server
    assert server["auth"]["tokens_file"] == "/etc/relayrl/secrets/buffer-auth/tokens.yaml"
    buffer = objects["StatefulSet", "math-grpo-buffer"]["spec"]["template"]["spec"]
    assert buffer["containers"][0]["readinessProbe"] == {"tcpSocket": {"port": 50051}, "periodSeconds": 5}
    assert {v["secret"]["secretName"] for v in buffer["volumes"] if "secret" in v} == {
        "math-grpo-buffer-tls", "math-grpo-buffer-auth"}
    trainer = objects["Job", "math-grpo-trainer"]["spec"]["template"]["spec"]["containers"][0]
    assert "--set=buffer.client.token=$(RELAYRL_BUFFER_TOKEN)" in trainer["command"]
    assert {"name": "RELAYRL_BUFFER_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "math-grpo-clients", "key": "buffer-token"}}} in trainer["env"]
    trainer_config = yaml.safe_load(config_map["trainer.yaml"])
    assert trainer_config["buffer"]["client"]["ca_cert"] == "/etc/relayrl/secrets/clients/buffer-ca_cert"
    driver = yaml.safe_load(config_map["driver.yaml"])
    assert driver["clients"]["buffer"]["cert"] == "/etc/relayrl/secrets/clients/buffer-cert"


def test_a_client_token_file_travels_in_the_clients_secret(tmp_path):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "run.token").write_text("token-from-a-file\n")
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (folder / name).write_text(f"-----BEGIN {name}-----\n")
    data = yaml.safe_load(EXAMPLE.read_text())
    data["services"]["reward"].update(tls={"cert": "cert.pem", "key": "key.pem"}, auth={"tokens": {}},
                                      client={"ca_cert": "ca.pem", "token_file": "run.token"})
    (folder / "experiment.yaml").write_text(yaml.safe_dump(data))
    objects = _by_kind(render(load_config(ExperimentConfig, folder / "experiment.yaml"), folder))
    secret = objects["Secret", "math-grpo-clients"]["data"]["reward-token"]
    assert base64.b64decode(secret).decode() == "token-from-a-file"
    driver = objects["Deployment", "math-grpo-driver"]["spec"]["template"]["spec"]["containers"][0]
    assert "--set=clients.reward.token=$(RELAYRL_REWARD_TOKEN)" in driver["command"]
    config_map = objects["ConfigMap", "math-grpo-config"]["data"]
    assert not any("token-from-a-file" in text for text in config_map.values())


@pytest.mark.parametrize(("change", "named"), [
    ("kubernetes.image=null", "kubernetes.image: not set"),
    ("kubernetes.project_claim=null", "kubernetes.project_claim: not set"),
    ("sft.steps=10", "sft.steps: 10, but the manifests run no SFT warm-up"),
    ("run_dir=/tmp/run", "run_dir: /tmp/run is absolute"),
    ("services.rollout.client={ca_cert: nowhere.pem}", "services.rollout.client.ca_cert: no file"),
])
def test_what_cannot_be_rendered_is_named(change, named):
    with pytest.raises(RenderError, match=named.replace("(", r"\(")):
        render(_example(change), EXAMPLE.parent)


def test_the_command_exits_2_naming_the_problem(tmp_path):
    done = _render_cli(tmp_path / "out", str(EXAMPLE), "--set", "services.buffer.replicas=2")
    assert done.returncode == 2 and "services.buffer.replicas: 2" in done.stderr
    assert not (tmp_path / "out").exists()


def test_rendered_files_start_the_real_processes(tmp_path):
    """A user's project rendered with the project volume at its own folder: the driver's init container writes the
    prompts, the reward pod's config and environment start the real reward service with the user's function, and
    the buffer's config starts the real buffer with the run's shared settings."""
    import grpc
    from user_project import experiment, write_project

    from deploy.local.service_process import start_service
    from protos import buffer_pb2, buffer_pb2_grpc, reward_pb2, reward_pb2_grpc

    folder = tmp_path / "project"
    write_project(folder, folder / "unused")
    data = {**experiment(folder, folder), "run_dir": "run", "groups": [{"name": "cpu"}],
            "services": {name: {"group": "cpu"} for name in ("buffer", "reward", "rollout", "trainer")},
            "kubernetes": {"image": "relayrl:test", "project_claim": "project", "project_path": str(folder)}}
    (folder / "experiment.yaml").write_text(yaml.safe_dump(data))
    objects = _by_kind(render(load_config(ExperimentConfig, folder / "experiment.yaml"), folder))
    files = tmp_path / "etc"
    files.mkdir()
    for name, text in objects["ConfigMap", "relayrl-config"]["data"].items():
        (files / name).write_text(text)

    init = objects["Deployment", "relayrl-driver"]["spec"]["template"]["spec"]["initContainers"][0]["command"]
    assert init[:3] == ["python", "-m", "deploy.experiment.data"]
    done = subprocess.run([sys.executable, *init[1:3], str(files / "experiment.yaml")], check=False,
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    prompts = (folder / "run" / "prompts.jsonl").read_text().splitlines()
    assert len(prompts) == 3 * 4 * 6 * 6 - 48  # every row but the 48 held out (data.num_eval)

    pod = objects["Deployment", "relayrl-reward"]["spec"]["template"]["spec"]["containers"][0]
    assert pod["command"][:3] == ["relayrl", "serve", "reward"]
    env = {item["name"]: item["value"] for item in pod["env"]}
    reward = start_service("reward", {"server.address": "127.0.0.1:0"}, config_path=files / "reward.yaml",
                           env={"PYTHONPATH": f"{env['PYTHONPATH']}:{ROOT}"}, log_dir=tmp_path / "logs")
    try:
        with grpc.insecure_channel(reward.address) as channel:
            listed = reward_pb2_grpc.RewardStub(channel).ListFunctions(reward_pb2.ListFunctionsRequest(), timeout=30)
        assert "experiment" in listed.names  # the user's my_reward:first_word, imported from the project volume
    finally:
        reward.stop()
    buffer = start_service("buffer", {"server.address": "127.0.0.1:0"}, config_path=files / "buffer.yaml",
                           log_dir=tmp_path / "logs")
    try:
        with grpc.insecure_channel(buffer.address) as channel:
            stats = buffer_pb2_grpc.BufferStub(channel).Stats(buffer_pb2.StatsRequest(), timeout=30)
        assert stats.capacity == 32 * 8 * 4 and stats.max_staleness == 1  # buffer_capacity_batches x batch
        assert (folder / "run" / "buffer").is_dir()  # its log in the run folder on the project volume
    finally:
        buffer.stop()
