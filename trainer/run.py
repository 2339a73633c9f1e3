"""Wire a training process: threads, logging, heartbeat, process group, buffer client, weight publisher."""

import contextlib
import logging
import os
import pathlib
import signal
import threading
import time
import uuid

import torch
import transformers

from services.device import transfer_backend
from services.metrics import start_metrics_endpoint
from services.runtime import Sparse
from services.tracing import current_traceparent, record_span, setup_tracing, span
from trainer.buffer_client import BufferClient
from trainer.checkpoint import TrainState
from trainer.config import TrainerConfig
from trainer.config.publish import PublishConfig
from trainer.loop import train
from trainer.parallel import init_distributed, shutdown_distributed
from trainer.receivers import RouterReceivers

log = logging.getLogger(__name__)


def run(config: TrainerConfig) -> TrainState:
    """Run one trainer process (one rank under torchrun) to the end of training: config.max_steps, or SIGTERM, after
    which the step under way ends and the weights it leaves are published, checkpointed and exported (rank 0's
    signal decides for every rank)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    if config.deterministic:
        from services.determinism import use_deterministic_torch

        use_deterministic_torch(config.num_threads)
    elif config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    transformers.utils.logging.disable_progress_bar()
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s trainer[{rank}] %(levelname)s %(message)s")
    env = init_distributed(config.device, config.dist_timeout_s, config.parallel.tp, config.parallel.pp,
                           config.parallel.ep)
    log.info("rank %d of %d (dp %d x tp %d) on %s (pid %d)", env.rank, env.world_size, env.dp_size, env.tp_size,
             env.device, os.getpid())  # where it landed
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(shutdown_distributed, env)
        source = publisher = None
        if env.is_main:
            setup_tracing("trainer", config.tracing)
            if config.heartbeat_path:
                cleanup.callback(Heartbeat(pathlib.Path(config.heartbeat_path), config.heartbeat_interval_s).close)
            if config.metrics_port is not None:
                log.info("metrics on 127.0.0.1:%d", start_metrics_endpoint(config.metrics_port))
            # A name of this process's own: the buffer tells a restarted trainer from the one it replaces.
            consumer = f"{config.buffer.consumer}/{uuid.uuid4().hex[:12]}"
            source = BufferClient(config.buffer.model_copy(update={"consumer": consumer}))
            cleanup.callback(source.close)
            if config.publish.receivers or config.publish.receivers_from:
                publisher = RolloutPublisher(config.publish, env.device, adapter=config.model.lora is not None)
                cleanup.callback(publisher.close)
        return train(config, env, source, publisher, stop)


class Heartbeat:
    """Touches `path` every `interval_s` from a daemon thread: it beats while the process runs, however long a
    step or a wait takes, and stops only when the whole process does (killed, or frozen by SIGSTOP)."""

    def __init__(self, path: pathlib.Path, interval_s: float) -> None:
        self.path, self.interval_s = path, interval_s
        self._stop = threading.Event()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self._thread = threading.Thread(target=self._run, name="relayrl-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.path.touch()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 1)


class WeightVersionConflict(RuntimeError):
    """Receivers keep refusing the trainer's versions as not newer: another trainer publishes to them."""


class RolloutPublisher:
    """publish(named_tensors, version) to the rollout workers, blocking; returns the version published.

    A worker that cannot take an update (down, or a failed transfer) keeps serving its old version (the
    buffer's staleness bound still holds): that is logged and it is tried again at the next publish. A
    version refused as not newer than what a worker serves means this trainer's counter is behind: the
    weights go out again once, under the next version above every worker's, and that version is returned
    (the loop's counter follows); refused again, WeightVersionConflict is raised.
    """

    def __init__(self, config: PublishConfig, device: torch.device | None = None, adapter: bool = False) -> None:
        """`device`: the trainer's; the NCCL backends send from it (gloo sends from the CPU). `adapter`: a LoRA
        policy's tensors (trainer/adapter_publish.py): the base once, then the adapter alone."""
        from trainer.broadcast.blocking import BlockingWeightBroadcaster
        from trainer.broadcast.config import BroadcastConfig

        self._log_level = Sparse()
        backend = transfer_backend(device or "cpu") if config.backend == "auto" else config.backend
        self._broadcaster = BlockingWeightBroadcaster(
            config.receivers,
            BroadcastConfig(backend=backend, bucket_mb=config.bucket_mb, timeout_s=config.timeout_s,
                            control_timeout_s=config.control_timeout_s, dtype=config.dtype, cuda_ipc=config.cuda_ipc,
                            delta=config.delta, adapter=adapter,
                            master_addr=config.master_addr, master_port=config.master_port, client=config.client),
            device if backend != "gloo" else None,
        )
        self._delta = config.delta == "auto" or adapter
        self._router = RouterReceivers(config.receivers_from, config.client) if config.receivers_from else None
        # The last publish's sync time (from BeginUpdate until every receiver switched) and the longest time an
        # engine stopped generating for it: what the loop reports as sync_s and pause_s.
        self.timings: dict[str, float] = {}
        self.last_report = None  # the last publish's PublishReport (each receiver's outcome, its error)

    def _follow_router(self) -> None:
        """With a router, publish to the replicas it lists now (trainer/receivers.py)."""
        if self._router is not None:
            self._broadcaster.set_receivers(self._router.current())

    def __call__(self, named_tensors: dict[str, torch.Tensor], version: int) -> int:
        with span("trainer.publish", weight_version=version):  # a weight version's trace: sampled as groups are
            try:
                return self._publish(named_tensors, version)
            finally:  # several senders (pipeline stages): they follow every round of this publish, then stop
                self._broadcaster.end_publish()

    def use_senders(self, peers) -> None:
        """Publish each version from several senders, this process sender 0 (trainer/broadcast/senders.py)."""
        self._broadcaster.use_senders(peers)

    def _publish(self, named_tensors: dict[str, torch.Tensor], version: int) -> int:
        self._follow_router()
        report = self._broadcaster.publish(named_tensors, version)
        sync_s = report.total_s
        if report.not_newer:
            served = self._broadcaster.served_versions()
            retry = max([version, *(v for v in served.values() if v is not None)]) + 1
            log.warning("weight version %d refused as not newer by %s (serving %s): publishing it as version %d",
                        version, report.not_newer, served, retry)
            report = self._broadcaster.publish(named_tensors, retry)
            sync_s += report.total_s
            if report.not_newer:
                raise WeightVersionConflict(
                    f"weight version {retry} refused as not newer by {report.not_newer} right after they served "
                    f"{served}: is another trainer publishing to them?"
                )
            version = retry
        self.timings = {"sync_s": sync_s, "pause_s": report.pause_s}
        self.last_report = report
        ended_ns = time.time_ns()
        for result in report.results:  # each engine's part, as its CommitUpdate reply gave it (the refit per receiver)
            self.timings.update({f"refit/{result.address}/{key}": getattr(result, key)
                                 for key in ("receive_s", "switch_s", "pause_s")})
            record_span("engine.update", current_traceparent(), ended_ns - int(report.total_s * 1e9), ended_ns,
                        receiver=result.address, ok=result.ok, receive_s=result.receive_s, switch_s=result.switch_s,
                        pause_s=result.pause_s)
        if self._delta and report.full_bytes:
            # delta sync: what the last version sent against its whole size, and the versions sent whole instead
            self.timings.update(publish_bytes_ratio=report.bytes / report.full_bytes,
                                delta_fallbacks=float(report.fallbacks))
        if report.ok:
            log.log(self._log_level.level(), "published weight version %d (%.1f MB) in %.2fs (engines paused %.3fs)",
                    version, report.bytes / 1e6, report.total_s, report.pause_s)
        else:
            log.warning("weight version %d not taken by %s", version, report.failed)
        return version

    def served_versions(self) -> dict[str, int | None]:
        """The version each worker serves now (None: it did not answer)."""
        self._follow_router()
        return self._broadcaster.served_versions()

    def bind(self, parameters: dict[str, torch.Tensor]) -> None:
        """Publish these parameters from their own memory from now on (WeightBroadcaster.bind)."""
        self._broadcaster.bind(parameters)

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A one-copy snapshot of the bound parameters to publish while they change."""
        return self._broadcaster.snapshot()

    def close(self) -> None:
        self._broadcaster.close()
        if self._router is not None:
            self._router.close()
