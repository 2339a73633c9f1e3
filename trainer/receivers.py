"""Who receives the trainer's weights when rollout replicas come and go: the replicas a rollout router lists.

With `publish.receivers_from` set to a router's address (rollout/router/router.py), every publish goes to the replicas
the router lists as JOINING or ACTIVE and alive, asked afresh before each publish and each check of the served
versions: a replica added mid-run receives the next publish (or the resync a waiting trainer sends to a receiver
behind), which is what lets the router route to it; a DRAINING one gets no more weights. A router that does not
answer leaves the last list in place.
"""

import logging

import grpc

from protos import router_pb2, router_pb2_grpc
from services.client import connect_sync
from services.config import ClientConfig

log = logging.getLogger(__name__)
_TAKES_WEIGHTS = (router_pb2.REPLICA_STATE_JOINING, router_pb2.REPLICA_STATE_ACTIVE)


class RouterReceivers:
    """The replicas of the router at `address` that take weights, read by `current()`."""

    def __init__(self, address: str, client: ClientConfig | None = None, timeout_s: float = 5.0):
        """`client`: how to reach the router (the rollout's TLS and token, as for the replicas themselves)."""
        self.address, self.timeout_s = address, timeout_s
        self._channel = connect_sync(address, client)
        self._stub = router_pb2_grpc.ReplicasStub(self._channel)
        self.last: list[str] = []

    def current(self) -> list[str]:
        try:
            reply = self._stub.ListReplicas(router_pb2.ListReplicasRequest(), timeout=self.timeout_s)
        except grpc.RpcError as exc:
            log.warning("router %s did not list its replicas (%s): publishing to %s", self.address,
                        exc.code().name, self.last)
            return self.last
        replicas = [r.address for r in reply.replicas if r.alive and r.state in _TAKES_WEIGHTS]
        if replicas != self.last:
            log.info("weight receivers from router %s: %s", self.address, replicas)
        self.last = replicas
        return replicas

    def close(self) -> None:
        self._channel.close()
