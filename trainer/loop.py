"""The training loop: pull a batch, train on it, ack it, publish weights, checkpoint.

Rank 0 talks to the buffer and hands every pulled batch to all ranks. A batch is acked only
after the optimizer step(s) that used it, so after a crash its lease expires and the buffer
delivers it again to the restarted trainer, which resumes from its last checkpoint.

Two waits can leave the critical path (config): the next batch's pull, started right after the ack
and running while weights are published and checkpoints written (`buffer.prefetch`), and the
weight transfer itself, running while the next step computes (`publish.overlap`).
"""

import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Protocol

import torch

from protos.sample import Sample
from trainer.buffer_client import LeasedBatch
from trainer.checkpoint import (
    TrainState,
    export_hf,
    hf_state_dict,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    ties_embeddings,
)
from trainer.config import PublishConfig, TrainerConfig
from trainer.learner import Learner
from trainer.parallel import DistEnv, gather_model_state

log = logging.getLogger(__name__)

# publish(named_tensors, version): hand new weights (Hugging Face names) to the rollout side.
Publisher = Callable[[dict[str, torch.Tensor], int], object]


class BatchSource(Protocol):
    """Where batches come from (the buffer client); used on rank 0 only."""

    def pull(self, batch_size: int) -> LeasedBatch: ...

    def ack(self, lease_id: str, trainer_version: int) -> int: ...

    def set_version(self, version: int) -> int: ...


class Background:
    """One call at a time on a daemon thread; its result or exception comes back from `wait`.

    Daemon: a call stuck in a wait of its own (a pull for a batch that never comes) cannot keep a
    stopping process alive; each such call has its own deadline too.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._future: Future | None = None

    @property
    def busy(self) -> bool:
        return self._future is not None

    def start(self, fn: Callable, *args) -> None:
        if self._future is not None:
            raise RuntimeError(f"{self.name}: a call is already in flight")
        future = self._future = Future()

        def run() -> None:
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller of wait(), who re-raises it
                future.set_exception(exc)

        threading.Thread(target=run, name=self.name, daemon=True).start()

    def wait(self, timeout_s: float):
        """The call's result (its exception is raised here); None when nothing is in flight."""
        future, self._future = self._future, None
        return None if future is None else future.result(timeout_s)


def train(config: TrainerConfig, env: DistEnv, source: BatchSource | None, publish: Publisher | None = None) -> TrainState:
    """Train until config.max_steps optimizer steps; resume from the latest checkpoint if any."""
    learner = Learner(config, env)
    state = resume(config, learner, env)
    if env.is_main:
        source.set_version(state.weight_version)
    publishing = env.broadcast_object(publish is not None)  # gathering weights is collective
    weights = policy_weights(learner, env, publish, config.publish) if publishing else None
    pull_wait_s = config.buffer.max_wait_s + config.buffer.pull_timeout_s + 30.0  # the pull's own deadline + slack
    publish_wait_s = config.publish.timeout_s + 60.0
    prefetch, sending = Background("relayrl-prefetch"), Background("relayrl-publish")
    if publishing and config.publish.overlap and env.is_main:
        publish = overlapped(publish, sending)
    if publishing and state.step > 0:
        publish_weights(weights, state.weight_version, publish, env)
    publish_s = 0.0  # the last publish's duration, reported with the steps after it
    while state.step < config.max_steps:
        started = time.monotonic()
        pulled = None
        if env.is_main:  # the batch prefetched after the last step's ack, else a pull now
            pulled = prefetch.wait(pull_wait_s) if prefetch.busy else source.pull(config.batch.global_batch_size)
        leased: LeasedBatch = env.broadcast_object(pulled)
        batch_stats = {
            **measure_staleness(leased.samples, state.weight_version, config.max_staleness),
            "reward_mean": sum(s.reward for s in leased.samples) / len(leased.samples),
            "pull_s": time.monotonic() - started,
            "publish_s": publish_s,
        }
        steps_before = state.step
        for mini_batch in learner.prepare(leased.samples):
            metrics = learner.train_step(mini_batch, state.step)
            state.step += 1
            state.weight_version += 1
            report(config, env, state, {**metrics, **batch_stats, "step_s": time.monotonic() - started}, leased)
        state.samples_trained += len(leased.samples)
        if env.is_main:
            source.ack(leased.lease_id, state.weight_version)
            if config.buffer.prefetch and state.step < config.max_steps:
                prefetch.start(source.pull, config.batch.global_batch_size)
        if publishing and _due(steps_before, state.step, config.publish.interval):
            publish_started = time.monotonic()
            sending.wait(publish_wait_s)  # the previous overlapped publish, if any
            publish_weights(weights, state.weight_version, publish, env)
            publish_s = time.monotonic() - publish_started
        if config.checkpoint.dir and _due(steps_before, state.step, config.checkpoint.interval):
            save_checkpoint(config.checkpoint.dir, learner.policy, learner.optimizer, state, env, config.checkpoint.keep_last)
    sending.wait(publish_wait_s)
    if config.checkpoint.dir:
        save_checkpoint(config.checkpoint.dir, learner.policy, learner.optimizer, state, env, config.checkpoint.keep_last)
    if config.checkpoint.export_dir:
        export_hf(config.checkpoint.export_dir, learner.policy, config.model_path, env)
    return state


def overlapped(send: Publisher, background: Background) -> Publisher:
    """A publisher that hands each publish to `background` and returns at once."""

    def start(named_tensors: dict[str, torch.Tensor], version: int) -> None:
        background.start(send, named_tensors, version)

    return start


def resume(config: TrainerConfig, learner: Learner, env: DistEnv) -> TrainState:
    """The state of the latest checkpoint (model and optimizer loaded), or a fresh start."""
    path = latest_checkpoint(config.checkpoint.dir)
    if path is None:
        return TrainState()
    state = load_checkpoint(path, learner.policy, learner.optimizer, env)
    log.info("resumed from %s at step %d (weight version %d)", path, state.step, state.weight_version)
    return state


def policy_weights(
    learner: Learner, env: DistEnv, publish: Publisher | None, config: PublishConfig
) -> Callable[[], dict[str, torch.Tensor]]:
    """What each publish sends: the policy under Hugging Face names on rank 0, {} elsewhere (collective).

    A trainer that holds its policy whole (one process) and sends it uncast binds the parameters to the
    broadcast's layout (`publish.bind`, see PublishConfig.bind): each publish then goes straight from their
    memory, or, overlapped with the next step, from a one-copy snapshot of it. Otherwise every publish
    gathers a full state dict, which the broadcaster packs into buckets.
    """
    tied = ties_embeddings(learner.policy)
    can_bind = not env.distributed and config.bind and config.dtype is None
    if can_bind and hasattr(publish, "bind"):
        parameters = hf_state_dict(dict(learner.policy.named_parameters()), tied)
        if set(parameters) == set(hf_state_dict(learner.policy.state_dict(), tied)):
            publish.bind(parameters)
            return publish.snapshot if config.overlap else lambda: parameters
        log.info("publishing gathered state dicts: the policy's state holds tensors that are not parameters")
    return lambda: hf_state_dict(gather_model_state(learner.policy, env), tied)


def publish_weights(
    weights: Callable[[], dict[str, torch.Tensor]], version: int, publish: Publisher | None, env: DistEnv
) -> None:
    """Take the policy's weights (collective) and publish them on rank 0 as `version`."""
    tensors = weights()
    if env.is_main:
        publish(tensors, version)


def measure_staleness(samples: Sequence[Sample], trainer_version: int, max_staleness: int | None) -> dict[str, float]:
    """How many versions behind the trainer the batch's samples are; fails beyond max_staleness."""
    lags = [trainer_version - s.oldest_version for s in samples if s.oldest_version >= 0]
    worst = max(lags, default=0)
    if max_staleness is not None and worst > max_staleness:
        raise ValueError(
            f"the buffer handed out a sample {worst} versions old at trainer version {trainer_version} "
            f"(max_staleness={max_staleness})"
        )
    return {"staleness_max": float(worst), "staleness_mean": sum(lags) / len(lags) if lags else 0.0}


def report(
    config: TrainerConfig, env: DistEnv, state: TrainState, metrics: dict[str, float], leased: LeasedBatch
) -> None:
    """Log one step (every log_interval) and append it to the metrics file (rank 0)."""
    if not env.is_main:
        return
    if config.metrics_path:
        record = {"step": state.step, "weight_version": state.weight_version, **metrics}
        if config.metrics_sample_ids:
            record.update(lease_id=leased.lease_id, sample_ids=[s.sample_id for s in leased.samples])
        with open(Path(config.metrics_path), "a") as f:
            f.write(json.dumps(record) + "\n")
    if state.step % config.log_interval == 0 or state.step == config.max_steps:
        shown = " | ".join(f"{name} {value:.4g}" for name, value in sorted(metrics.items()))
        log.info("step %d/%d | %s", state.step, config.max_steps, shown)


def _due(steps_before: int, steps_after: int, every: int) -> bool:
    """Whether a multiple of `every` was reached by the steps just taken."""
    return steps_after // every > steps_before // every
