"""A WeightBroadcaster for a synchronous training loop: `publish` blocks; the asyncio side runs on its own thread."""

import asyncio
import threading
from collections.abc import Mapping, Sequence

import torch

from services.tracing import carry_context
from trainer.broadcast.broadcaster import PublishReport, WeightBroadcaster
from trainer.broadcast.config import BroadcastConfig
from trainer.broadcast.senders import Peers
from trainer.broadcast.transport import Tensors


class BlockingWeightBroadcaster:
    """A WeightBroadcaster for synchronous code: `publish` blocks; the asyncio side runs on its own thread."""

    def __init__(self, receivers: Sequence[str], config: BroadcastConfig | None = None,
                 device: torch.device | str | None = None):
        self.broadcaster = WeightBroadcaster(receivers, config, device)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="weight-broadcast", daemon=True)
        self._thread.start()

    def publish(self, named_tensors: Tensors, version: int) -> PublishReport:
        return self._run(self.broadcaster.publish(named_tensors, version), self.broadcaster.config.publish_bound_s)

    def served_versions(self, addresses: Sequence[str] | None = None) -> dict[str, int | None]:
        return self._run(self.broadcaster.served_versions(addresses), 2 * self.broadcaster.config.control_timeout_s)

    def bind(self, parameters: Mapping[str, torch.Tensor]) -> None:
        """WeightBroadcaster.bind; call it while no publish is in flight."""
        self.broadcaster.bind(parameters)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """WeightBroadcaster.snapshot; call it while no publish is in flight."""
        return self.broadcaster.snapshot()

    def use_senders(self, peers: Peers) -> None:
        """WeightBroadcaster.use_senders; call it before the first publish."""
        self.broadcaster.use_senders(peers)

    def end_publish(self) -> None:
        """WeightBroadcaster.end_publish (blocking, from the thread that publishes)."""
        self.broadcaster.end_publish()

    def set_receivers(self, receivers: Sequence[str]) -> None:
        self._loop.call_soon_threadsafe(self.broadcaster.set_receivers, list(receivers))

    def close(self) -> None:
        self._run(self.broadcaster.close(), self.broadcaster.config.control_timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=self.broadcaster.config.control_timeout_s)

    def _run(self, coro, timeout: float):
        # the caller's trace context goes with the calls (a traced publish: services/tracing.py)
        return asyncio.run_coroutine_threadsafe(carry_context(coro), self._loop).result(timeout)
