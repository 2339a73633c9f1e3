"""A torchrun job, one torchrun per node, as ONE supervised member (deploy/local/supervisor.py).

The ranks on every node rendezvous together, so they stand and fall together: the job runs while any node runs;
it is done (exit 0) when every node exited 0; a non-zero exit of any node ends the other nodes at once (their ranks
would otherwise wait in a collective until the process-group timeout) and is the job's exit code. The supervisor's
restart policy then starts every node again, from the latest checkpoint, as it does a one-process trainer. The
job's heartbeat is rank 0's file; its log is node 0's, or the failing node's once one failed.

torchrun starts each rank in a session of its own and ends them only when it is signalled itself (SIGTERM: it
SIGTERMs its ranks, SIGKILLs them after 30 s): a SIGKILLed torchrun would leave its ranks running, so even a kill
is a SIGTERM first, with SIGKILL only after TORCHRUN_GRACE_S.
"""

import pathlib
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from deploy.local.supervisor import Process

TORCHRUN_GRACE_S = 35.0  # torchrun's own 30 s for its ranks to end after its SIGTERM, and some


class NodeJob(Process):
    """`nodes` (node rank order: node 0 hosts the rendezvous and rank 0), each a torchrun Process on its own node (a
    deploy.cluster.ray_launcher.RayProcess), supervised as one member named `name`."""

    def __init__(self, name: str, nodes: Sequence[Process], exit_zero_is_done: bool = False,
                 heartbeat: pathlib.Path | None = None):
        super().__init__(name, nodes[0].args, nodes[0].log_path, exit_zero_is_done, heartbeat)
        self.nodes = list(nodes)
        self.failed: Process | None = None  # the node whose non-zero exit ended this start of the job
        self.failed_code: int | None = None

    def start(self, timeout: float) -> None:
        self.started_at = time.time()
        self.failed, self.failed_code, self.log_path = None, None, self.nodes[0].log_path
        for node in self.nodes:
            node.start(timeout)

    @property
    def pid(self) -> int:
        return self.nodes[0].pid

    def exit_code(self) -> int | None:
        """None while any node runs; 0 once all exited 0; the first non-zero code seen (the other nodes ended)."""
        if self.failed is not None:
            return self.failed_code
        codes = [node.exit_code() for node in self.nodes]
        for node, code in zip(self.nodes, codes):
            if code:
                self.failed, self.failed_code, self.log_path = node, code, node.log_path
                self.kill()
                return code
        return 0 if all(code == 0 for code in codes) else None

    def kill(self) -> None:
        """End every node and its ranks (a SIGTERM first: see the module's docstring)."""
        self.stop(TORCHRUN_GRACE_S)

    def stop(self, timeout: float = TORCHRUN_GRACE_S) -> None:
        """SIGTERM every node at once, SIGKILL each after `timeout` seconds."""
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(lambda node: node.stop(timeout), self.nodes))

    def log_tail(self, lines: int = 40) -> str:
        return (self.failed or self.nodes[0]).log_tail(lines)
