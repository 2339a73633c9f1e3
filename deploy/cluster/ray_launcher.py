"""`relayrl run FILE --ray ADDRESS`: a run's processes on the nodes of a Ray cluster, each on its node group.

    a node group's name is a Ray custom resource its nodes carry (`ray start --resources '{"inference": 1}'`)
    -> one agent (a Ray actor) per process, placed with resources={group: ...}: buffer, reward and rollout on their
       groups, the trainer on its group, the driver beside the buffer; no group = any node. Rollout replicas
       (deploy/local/replicas.py: "rollout-1", ... behind the router "rollout") get an agent each on the rollout's group,
       made as each starts (a replica added by `relayrl deploy scale` too); so do reward replicas ("reward-1", ...:
       no router, the driver and the evaluation call one target naming them all, deploy.rl.pipeline.start_reward)
    -> a trainer on `services.trainer.nodes` > 1 nodes: a Ray placement group of that many bundles of its group's
       resource, STRICT_SPREAD (each on a distinct node), and an agent in each: "trainer" (node rank 0),
       "trainer-node1", ...; each runs torchrun with --node-rank, static rendezvous on node 0's IP at
       `services.trainer.rendezvous_port`, logging to logs/<its name>.log
    -> each agent starts its process on its node: a service by deploy.local.service_process.start_service (`relayrl serve NAME`
       bound to the node's IP and a free port, health-checked there), the trainer and the driver as `python -m ...`
    -> the addresses handed to the driver, the trainer and the evaluation are node IP + bound port, as placed; the
       trainer's weight rendezvous binds its node rank 0's IP (publish.master_addr)
    -> this machine's supervisor (deploy/local/supervisor.py) watches each through its agent: health checks, heartbeats,
       restarts on the same node and address, the same bounds as a local run; a trainer across nodes is one member
       (deploy/local/node_job.py): one node's failure restarts the whole torchrun job from its checkpoint
    -> a node lost (its agent's actor died with it, or the agent answers nothing for AGENT_TIMEOUT_S): a call on the
       agent raises deploy.local.supervisor.MemberLost, and the process leaves placement.json. A rollout replica is
       replaced (deploy/local/replicas.py): a new one, with a new agent on a node of the group that is left (replica agents
       are SPREAD over the group's nodes, so one node takes as few as it can), joins the router and takes traffic
       once it serves the current weights; the lost one leaves the router and services.json; the driver's requests
       on it re-run on the others. Any other process (buffer, reward, the router, a trainer node, the driver) fails
       the run at once with RunFailed naming it and the node: the others hold its address, and its state (the
       buffer's log, the trainer's ranks) went with it or is in the shared run folder: `relayrl run --resume RUN_DIR
       --ray ADDRESS` goes on from there

Every node needs relayrl installed in the same Python environment, and the run folder and the model on a filesystem
every node sees at the same path (logs, heartbeats, checkpoints and metrics are read there), as Kubernetes' project
claim; so do the experiment's TLS files and the run's owner-only token files (deploy/local/security.py: each service's
certificate must name the IPs of the nodes it may run on). Not yet: a trainer across nodes without a group, and
surviving the loss of any node but a rollout replica's (the head's ends the Ray cluster itself).
"""

import json
import pathlib
import secrets
import threading
import time
from collections.abc import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deploy.experiment.placement import ServicesSection
from deploy.local.node_job import NodeJob
from deploy.local.service_process import start_service, tail_of
from deploy.local.supervisor import MemberLost, Process

GROUP_SHARE = 0.001  # what one agent takes of its group's resource: the resource marks nodes, it does not count
PLACE_TIMEOUT_S = 120.0
AGENT_TIMEOUT_S = 60.0  # an agent that answers a call no sooner than this (beyond the call's own time) is lost
PLACEMENT_FILE = "placement.json"


@ray.remote(num_cpus=0, max_concurrency=4)
class NodeAgent:
    """Holds one process on the node Ray placed it on: a service (deploy.local.service_process.ServiceProcess) or a client."""

    def __init__(self) -> None:
        self.member = None  # a deploy.local.service_process.ServiceProcess or a deploy.local.supervisor.Process, once started

    def node(self) -> tuple[str, str]:
        """(Ray node id, node IP) of where this agent runs."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def serve(self, name: str, overrides: dict, log_dir: str, registry: str, env: dict | None,
              timeout: float, label: str | None = None, client=None) -> tuple[str, int, int | None]:
        """Start `relayrl serve NAME` on this node's IP (its fixed port, or a free one); (address, pid, metrics)."""
        port = str(overrides.get("server.address", ":0")).rsplit(":", 1)[1]
        overrides = {**overrides, "server.address": f"{ray.util.get_node_ip_address()}:{port}"}
        self.member = start_service(name, overrides, log_dir=log_dir, registry=registry, env=env, timeout=timeout,
                                    label=label, client=client)
        return self.member.address, self.member.pid, self.member.metrics_port

    def restart(self, timeout: float) -> tuple[int, int | None]:
        self.member.restart(timeout)
        return self.member.pid, self.member.metrics_port

    def spawn(self, args: list[str], log_path: str) -> int:
        """Start `python ARGS` on this node, as deploy.local.supervisor.Process does on one machine; its pid."""
        self.member = Process(pathlib.Path(log_path).stem, args, pathlib.Path(log_path))
        self.member.start(0)
        return self.member.pid

    def exit_code(self) -> int | None:
        return self.member.exit_code()

    def kill(self) -> None:
        self.member.kill()

    def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds."""
        self.member.stop(timeout)


class Agent:
    """One agent as its member's handle sees it: calls on it, and its node's loss as MemberLost (its actor died with
    the node, or it answered nothing for AGENT_TIMEOUT_S beyond the call's own time), which the launcher is told."""

    def __init__(self, label: str, actor, node: tuple[str, str], on_lost: Callable[[str], None]):
        self.label, self.actor, self.on_lost = label, actor, on_lost
        self.where = f"its Ray node {node[1]} (node id {node[0][:12]})"

    def call(self, method: str, *args, timeout: float = 0.0):
        """`method(*args)` on the agent, answered within `timeout` + AGENT_TIMEOUT_S."""
        deadline = time.monotonic() + timeout + AGENT_TIMEOUT_S
        while True:
            try:
                return ray.get(getattr(self.actor, method).remote(*args),
                               timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.ActorUnavailableError:  # unreachable for now: the node may come back, or die
                if time.monotonic() >= deadline:
                    self._lost("its agent stayed unreachable")
                time.sleep(1.0)
            except ray.exceptions.ActorDiedError as exc:
                self._lost(f"its agent died ({str(exc).splitlines()[0]})")
            except ray.exceptions.GetTimeoutError:
                self._lost(f"its agent answered no {method} within {timeout + AGENT_TIMEOUT_S:.0f}s")

    def _lost(self, cause: str):
        self.on_lost(self.label)
        raise MemberLost(self.label, self.where, cause) from None


class RayService:
    """A service started by its agent, as the supervisor sees a deploy.local.service_process.ServiceProcess."""

    def __init__(self, name: str, agent: Agent, address: str, pid: int, metrics_port: int | None,
                 log_path: pathlib.Path, client=None):
        self.name, self.agent, self.address, self.pid = name, agent, address, pid
        self.metrics_port, self.log_path, self.client = metrics_port, log_path, client

    def restart(self, timeout: float = 120.0) -> None:
        self.pid, self.metrics_port = self.agent.call("restart", timeout, timeout=timeout)

    def exit_code(self) -> int | None:
        return self.agent.call("exit_code")

    def alive(self) -> bool:
        return self.exit_code() is None

    def kill(self) -> None:
        self.agent.call("kill", timeout=30.0)

    def stop(self, timeout: float = 15.0) -> None:
        self.agent.call("stop", timeout, timeout=timeout)

    def log_tail(self, lines: int = 40) -> str:
        """Read on the shared run folder (a lost node need not answer)."""
        return tail_of(self.log_path, lines)


class RayProcess(Process):
    """A client process (trainer, driver) started by its agent; heartbeat files are read on the shared run folder."""

    def __init__(self, agent: Agent, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.agent, self._pid = agent, 0

    def start(self, timeout: float) -> None:
        self.started_at = time.time()
        self._pid = self.agent.call("spawn", self.args, str(self.log_path), timeout=timeout)

    @property
    def pid(self) -> int:
        return self._pid

    def exit_code(self) -> int | None:
        return self.agent.call("exit_code")

    def kill(self) -> None:
        self.agent.call("kill", timeout=30.0)

    def stop(self, timeout: float = 20.0) -> None:
        self.agent.call("stop", timeout, timeout=timeout)


class PlacementError(RuntimeError):
    """The cluster has no node (or not enough distinct nodes) for a process's group within the place timeout."""


class RayLauncher:
    """Places one agent per process of a run on the Ray cluster at `address` (deploy.rl.pipeline's launcher)."""

    def __init__(self, address: str, services: ServicesSection, place_timeout_s: float = PLACE_TIMEOUT_S):
        ray.init(address=address, log_to_driver=False, include_dashboard=False)
        self.services = services
        self.tag = secrets.token_hex(3)
        self.place_timeout_s = place_timeout_s
        self.groups = {name: placement.group for name, placement in services.placed().items()}
        self.groups["driver"] = services.buffer.group
        # The trainer's agents in node rank order; across nodes, each in its bundle of a STRICT_SPREAD placement group.
        self.trainer_nodes = ["trainer", *(f"trainer-node{rank}" for rank in range(1, services.trainer.nodes))]
        self.groups.update({label: services.trainer.group for label in self.trainer_nodes})
        self.spread = self._spread_trainer() if services.trainer.nodes > 1 else None
        # Reward replicas get an agent each as they start (service(), label "reward-1", ...); "reward" itself none.
        replicated = {"reward"} if services.reward.replicas > 1 else set()
        self.agents = {name: self._new_agent(name, group) for name, group in self.groups.items()
                       if name not in replicated}
        self.nodes: dict[str, tuple[str, str]] = {}
        for name in self.agents:
            self._place(name)
        self.placement_path: pathlib.Path | None = None  # beside services.json, once the first service starts
        self._lock = threading.Lock()  # supervisor threads place replicas and learn of lost nodes at once

    def _spread_trainer(self):
        """A placement group of one bundle of the trainer's group resource per trainer node, each on a distinct node."""
        trainer = self.services.trainer
        spread = placement_group([{trainer.group: GROUP_SHARE}] * trainer.nodes, strategy="STRICT_SPREAD",
                                 name=f"relayrl-{self.tag}-trainer")
        if not spread.wait(self.place_timeout_s):
            remove_placement_group(spread)
            raise PlacementError(f"services.trainer.nodes: {trainer.nodes}, but the Ray cluster had no {trainer.nodes} "
                               f"distinct nodes with resource {trainer.group!r} within {self.place_timeout_s:.0f}s "
                               f"(start each with --resources '{{\"{trainer.group}\": 1}}')")
        return spread

    def _new_agent(self, name: str, group: str | None, spread: bool = False):
        """An agent on a node of `group`; `spread`: on the group's nodes in turn (Ray's SPREAD), not packed on one,
        so that one lost node takes as few of a service's replicas as it can."""
        options = {"resources": {group: GROUP_SHARE}} if group else {}
        if spread:
            options["scheduling_strategy"] = "SPREAD"
        if self.spread is not None and name in self.trainer_nodes:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.spread,
                                                                              self.trainer_nodes.index(name))
        return NodeAgent.options(name=f"relayrl-{self.tag}-{name}", **options).remote()

    def _place(self, name: str) -> None:
        """Wait until Ray has placed `name`'s agent on a node; record the node."""
        group = self.groups[name]
        try:
            self.nodes[name] = ray.get(self.agents[name].node.remote(), timeout=self.place_timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PlacementError(f"services.{name}: no Ray node with resource {group!r} took it within "
                               f"{self.place_timeout_s:.0f}s (start its nodes with --resources "
                               f"'{{\"{group}\": 1}}')") from None

    def placement(self) -> dict[str, dict]:
        """Where Ray placed each process: {name: {group, node_id, ip}}."""
        return {name: {"group": self.groups[name], "node_id": node_id, "ip": ip}
                for name, (node_id, ip) in self.nodes.items()}

    def _write_placement(self) -> None:
        self.placement_path.write_text(json.dumps(self.placement(), indent=2))

    def _agent(self, label: str) -> Agent:
        return Agent(label, self.agents[label], self.nodes[label], self.lost)

    def lost(self, label: str) -> None:
        """`label`'s node is gone (its agent with it): it leaves the placement (placement.json) and is not killed
        at the end."""
        with self._lock:
            if self.agents.pop(label, None) is None:
                return
            del self.nodes[label]
            if self.placement_path is not None:
                self._write_placement()

    def release(self, label: str) -> None:
        """`label`'s process was stopped for good (a replica scaled away): its agent ends and leaves the placement."""
        with self._lock:
            agent = self.agents.pop(label, None)
            self.nodes.pop(label, None)
            if self.placement_path is not None:
                self._write_placement()
        if agent is not None:
            ray.kill(agent)

    def service(self, name: str, overrides: dict, log_dir: pathlib.Path, registry: pathlib.Path,
                env: dict[str, str] | None = None, label: str | None = None, client=None) -> RayService:
        """Start `name` on its agent's node; the placement is recorded beside the run's services.json. A `label`
        not placed yet (a rollout replica, "rollout-2") gets a new agent on `name`'s group."""
        label = label or name
        with self._lock:
            if label not in self.agents:
                self.groups[label] = self.groups[name]
                self.agents[label] = self._new_agent(label, self.groups[name], spread=True)
                self._place(label)
            self.placement_path = registry.with_name(PLACEMENT_FILE)
            self._write_placement()
        agent = self._agent(label)
        address, pid, metrics_port = agent.call("serve", name, overrides, str(log_dir), str(registry), env,
                                                PLACE_TIMEOUT_S, label, client, timeout=PLACE_TIMEOUT_S)
        return RayService(label, agent, address, pid, metrics_port, log_dir / f"{label}.log", client)

    def process(self, name: str, args: list[str], log_path: pathlib.Path, exit_zero_is_done: bool = False,
                heartbeat: pathlib.Path | None = None) -> RayProcess | NodeJob:
        """A client process on its agent's node; a trainer of several processes is a torchrun job (NodeJob) of
        one torchrun per trainer node, each logging to logs/<its agent's name>.log."""
        trainer = self.services.trainer
        if name != "trainer" or trainer.world_size == 1:
            return RayProcess(self._agent(name), name, args, log_path, exit_zero_is_done, heartbeat)
        nodes = [RayProcess(self._agent(label), label, [*self._torchrun(rank), *args], log_path.with_name(f"{label}.log"))
                 for rank, label in enumerate(self.trainer_nodes)]
        return NodeJob(name, nodes, exit_zero_is_done, heartbeat)

    def _torchrun(self, node_rank: int) -> list[str]:
        """`python` arguments of torchrun on the trainer's node `node_rank`: standalone on one node; across nodes a
        static rendezvous at node 0's IP and services.trainer.rendezvous_port, hosted by node 0's torchrun."""
        trainer = self.services.trainer
        torchrun = ["-m", "torch.distributed.run", "--nproc-per-node", str(trainer.procs_per_node)]
        if trainer.nodes == 1:
            return [*torchrun, "--standalone"]
        return [*torchrun, "--nnodes", str(trainer.nodes), "--node-rank", str(node_rank),
                "--master-addr", self.nodes["trainer"][1], "--master-port", str(trainer.rendezvous_port)]

    def trainer_settings(self) -> dict:
        """The weight rendezvous on the trainer's node, where the rollout reaches it."""
        sync = self.services.trainer.weight_sync
        return {"publish": {"master_addr": sync.address or self.nodes["trainer"][1], "master_port": sync.port}}

    def close(self) -> None:
        for agent in self.agents.values():
            ray.kill(agent)
        if self.spread is not None:
            remove_placement_group(self.spread)
        ray.shutdown()
