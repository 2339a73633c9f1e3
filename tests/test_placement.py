"""Node groups in the experiment file (deploy/experiment/placement.py): typed, validated, errors that name the field, and
every experiment file written before them still valid (no groups = everything on this machine)."""

import copy
import pathlib

import pytest
import yaml

from deploy.experiment.schema import ExperimentConfig, load_experiment
from services.config import ConfigError, load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHIPPED = sorted([*ROOT.glob("examples/*/experiment.yaml"), ROOT / "deploy" / "experiment" / "quickstart_experiment.yaml"])

CLUSTER = {
    "model": {"path": "model"},
    "data": {"train": {"path": "train.jsonl"}},
    "groups": [
        {"name": "training", "selector": {"pool": "h100"}, "devices_per_node": 8},
        {"name": "inference", "hosts": ["gpu-1", "gpu-2"], "devices_per_node": 4},
        {"name": "cpu", "selector": {"pool": "cpu"}},
    ],
    "services": {
        "buffer": {"group": "cpu", "port": 50051, "resources": {"cpu": 2, "memory": "8Gi"}},
        "reward": {"group": "cpu", "replicas": 2, "port": 50052},
        "rollout": {"group": "inference", "replicas": 2, "resources": {"gpus": 4}},
        "trainer": {"group": "training", "nodes": 2, "procs_per_node": 8, "resources": {"gpus": 8},
                    "weight_sync": {"port": 29500}},
    },
}


def _load(tmp_path, data: dict, changes=()) -> ExperimentConfig:
    """Load `data` with `changes` ('a.0.b=value', list items by index) applied to a copy."""
    data = copy.deepcopy(data)
    for change in changes:
        key, _, value = change.partition("=")
        *parents, last = [int(part) if part.isdigit() else part for part in key.split(".")]
        node = data
        for part in parents:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]
        node[last] = yaml.safe_load(value)
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_config(ExperimentConfig, path)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(ROOT)))
def test_experiment_files_without_groups_stay_valid_and_local(path):
    config = load_experiment(path)
    if not config.groups:
        assert all(p.group is None for p in config.services.placed().values())
        assert config.services.trainer.world_size == 1


def test_groups_and_placements_are_typed(tmp_path):
    config = _load(tmp_path, CLUSTER)
    assert [g.name for g in config.groups] == ["training", "inference", "cpu"]
    assert config.groups[0].selector == {"pool": "h100"} and config.groups[1].hosts == ["gpu-1", "gpu-2"]
    assert config.services.reward.replicas == 2 and config.services.rollout.resources.gpus == 4
    assert config.services.buffer.resources.memory == "8Gi" and config.services.buffer.resources.cpu == 2.0
    trainer = config.services.trainer
    assert (trainer.nodes, trainer.procs_per_node, trainer.world_size) == (2, 8, 16)
    assert trainer.weight_sync.port == 29500 and trainer.weight_sync.address is None
    assert trainer.rendezvous_port == 29400


def test_devices_are_checked_only_where_given(tmp_path):
    config = _load(tmp_path, CLUSTER, ["groups.2.devices_per_node=0", "services.trainer.group=cpu",
                                       "services.trainer.procs_per_node=16", "services.trainer.resources.gpus=0"])
    assert config.services.trainer.procs_per_node == 16


@pytest.mark.parametrize(("override", "named"), [
    ("services.reward.group=gpus", "services.reward.group: 'gpus' is not a group (groups: cpu, inference, training)"),
    ("services.trainer.group=nowhere", "services.trainer.group: 'nowhere' is not a group"),
    ("services.buffer.replicas=2", "services.buffer.replicas: 2, but the buffer runs as exactly one process"),
    ("services.trainer.procs_per_node=9", "services.trainer.procs_per_node: 9, but group 'training' has 8 devices"),
    ("services.rollout.resources.gpus=5", "services.rollout.resources.gpus: 5, but group 'inference' has 4 devices"),
    ("services.trainer.group=inference", "services.trainer.procs_per_node: 8, but group 'inference' has 4"),
    ("groups.0.hosts=[a]", "services.trainer.nodes: 2, but group 'training' lists 1 hosts"),
    ("services.rollout.replicas=3", "services.rollout.replicas: 3 x 4 GPUs, but group 'inference' has 2 hosts x 4"),
    ("groups.2.name=training", "groups.2.name: 'training' names two groups"),
    ("groups.0.name=Training", "groups.0.name: String should match pattern"),
    ("services.buffer.resources.memory=8GB", "services.buffer.resources.memory: String should match pattern"),
    ("services.reward.replicas=0", "services.reward.replicas: Input should be greater than or equal to 1"),
    ("services.trainer.nodes=0", "services.trainer.nodes: Input should be greater than or equal to 1"),
    ("services.rollout.auth={tokens_file: tokens.yaml}", "services.rollout.client.token: rollout has auth on"),
    ("services.rollout.tls={cert: c.pem}", "services.rollout.tls.key: Field required"),
    ("services.rollout.tls={cert: c.pem, key: k.pem}", "services.rollout.client.ca_cert: rollout serves TLS"),
    ("services.rollout.client={token: t}", "services.rollout.tls: a token never crosses a network in plain text"),
    ("services.trainer.replicas=2", "services.trainer.replicas: Extra inputs are not permitted"),
    ("training={groups_per_batch: 3}", "services.trainer: 2 x 8 processes do not split the 24 samples"),
])
def test_a_bad_placement_names_the_field(tmp_path, override, named):
    with pytest.raises(ConfigError) as error:
        _load(tmp_path, CLUSTER, [override])
    assert named in str(error.value)


def test_two_local_services_on_one_port_are_an_error(tmp_path):
    data = {"model": {"path": "m"}, "data": {"train": {"path": "t.jsonl"}},
            "services": {"buffer": {"port": 50051}, "rollout": {"port": 50051}}}
    with pytest.raises(ConfigError, match=r"services.rollout.port: 50051 is also services.buffer.port"):
        _load(tmp_path, data)
    data["services"]["rollout"]["group"] = "inference"
    data["groups"] = [{"name": "inference"}]
    assert _load(tmp_path, data).services.rollout.port == 50051  # on another machine: no clash


def test_relayrl_run_refuses_what_it_cannot_place_on_this_machine(tmp_path, capsys):
    from deploy.runs.experiment_run import main as run

    _load(tmp_path, CLUSTER)
    assert run(str(tmp_path / "experiment.yaml")) == 2
    err = capsys.readouterr().err
    for named in ("services.buffer.group: 'cpu'", "services.reward.port: 50052 with 2 replicas",
                  "services.trainer: 2 x 8 processes"):
        assert named in err, err
    assert "services.reward.replicas" not in err  # its replicas run on this machine (deploy.rl.pipeline.start_reward)


def test_a_local_run_takes_rollout_replicas_behind_a_router(tmp_path):
    """services.rollout.replicas on this machine: not refused; the plan starts that many behind a router and the
    trainer publishes to the router's replicas (deploy/local/replicas.py)."""
    from deploy.experiment.placement import local_problems
    from deploy.rl.config import Addresses, trainer_config
    from deploy.runs.experiment_run import pipeline_plan

    local = {"model": {"path": "model"}, "data": {"train": {"path": "train.jsonl"}},
             "services": {"rollout": {"replicas": 3, "port": 50053}}}
    config = _load(tmp_path, local)
    assert local_problems(config.services) == []
    plan = pipeline_plan(config, tmp_path / "run", tmp_path / "model", tmp_path / "prompts.jsonl")
    assert plan.rl.rollout_replicas == 3
    publish = trainer_config(plan, Addresses("b:1", "r:2", "router:3"))["publish"]
    assert publish["receivers_from"] == "router:3" and "receivers" not in publish
    single = pipeline_plan(_load(tmp_path, local, ["services.rollout.replicas=1"]), tmp_path / "run",
                           tmp_path / "model", tmp_path / "prompts.jsonl")
    assert trainer_config(single, Addresses("b:1", "r:2", "x:3"))["publish"]["receivers"] == ["x:3"]


def test_a_local_run_takes_reward_replicas_on_free_ports(tmp_path):
    """services.reward.replicas on this machine and on Ray: not refused (issue 16), the plan starts that many; a fixed
    port cannot be shared by them (the rollout's goes to its router), so it is refused with the field named."""
    from deploy.experiment.placement import local_problems, ray_problems
    from deploy.runs.experiment_run import pipeline_plan

    local = {"model": {"path": "model"}, "data": {"train": {"path": "train.jsonl"}},
             "services": {"reward": {"replicas": 3}, "rollout": {"replicas": 2, "port": 50053}}}
    config = _load(tmp_path, local)
    assert local_problems(config.services) == [] and ray_problems(config.services) == []
    plan = pipeline_plan(config, tmp_path / "run", tmp_path / "model", tmp_path / "prompts.jsonl")
    assert plan.rl.reward_replicas == 3 and "server.address" not in plan.reward
    fixed = _load(tmp_path, local, ["services.reward.port=50052"]).services
    problem = "services.reward.port: 50052 with 3 replicas (each replica takes a free port: set port: 0)"
    assert local_problems(fixed) == ray_problems(fixed) == [problem]
    one = _load(tmp_path, local, ["services.reward.port=50052", "services.reward.replicas=1"])
    assert local_problems(one.services) == []  # one reward process listens on its fixed port
    assert pipeline_plan(one, tmp_path / "run", tmp_path / "model",
                         tmp_path / "prompts.jsonl").reward["server.address"] == "127.0.0.1:50052"


def test_relayrl_run_on_ray_refuses_what_its_launcher_cannot_do_yet(tmp_path, capsys):
    from deploy.runs.experiment_run import main as run

    _load(tmp_path, CLUSTER)
    assert run(str(tmp_path / "experiment.yaml"), ray_address="127.0.0.1:1") == 2  # before connecting to anything
    err = capsys.readouterr().err
    assert "services.reward.port: 50052 with 2 replicas" in err, err
    assert "services.buffer.group" not in err  # groups are what Ray places
    assert "services.reward.replicas" not in err  # each reward replica gets an agent on the reward's group
    assert "services.rollout.replicas" not in err  # its replicas run behind a router, each on the rollout's group
    assert "services.trainer" not in err  # its nodes spread over its group's nodes (deploy/cluster/ray_launcher.py)
    _load(tmp_path, CLUSTER, ["services.trainer.group=null"])
    assert run(str(tmp_path / "experiment.yaml"), ray_address="127.0.0.1:1") == 2
    assert "services.trainer.group: none, but a trainer on 2 nodes needs the group" in capsys.readouterr().err
