"""`relayrl serve rollout`: an engine in this process, or, with `router` set, a router in front of workers.

The two modes share one config file shape: the replica's (rollout/serve/config.py) plus `router`. The choice is
made here, above both, so that the router (rollout/router/) and the engine's service (rollout/serve/) never
import each other.
"""

from pydantic import Field

from rollout.router.router import RouterSettings
from rollout.serve.config import ReplicaConfig


class Config(ReplicaConfig):
    """`relayrl serve rollout` configuration."""

    router: RouterSettings | None = Field(None, description="Route to rollout replicas or decode workers "
                                          "(rollout/router/router.py) instead of serving an engine here; None: this "
                                          "process generates (the default).")


async def serve(config: Config) -> None:
    """Serve Rollout until SIGTERM: routed over `config.router`'s workers, or from an engine loaded here."""
    if config.router is not None:
        from rollout.router.service import serve_router

        await serve_router(config)
    else:
        from rollout.serve.service import serve_engine

        await serve_engine(config)
