"""The training loop: pull a batch, train on it, publish weights, checkpoint, then ack what the checkpoint holds.

Rank 0 talks to the buffer and hands every pulled batch to all ranks. Leases are kept open by a heartbeat
and acked only once a checkpoint that includes their training is durable (trainer/leases.py), so after a
crash every acknowledged sample was trained exactly once in the resumed model's history. Weight versions
are a job-wide counter: a trainer continues from the highest version its checkpoint, the buffer or any
rollout worker has seen, and a version the workers refuse as not newer moves the counter on.

Two waits can leave the critical path (config): the next batch's pull, started right after the step's
lease is marked consumed and running while weights are published and checkpoints written
(`buffer.prefetch`), and the weight transfer itself, running while the next step computes (`publish.overlap`).
"""

import json
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from protos.sample import Sample
from services.determinism import canonical_key
from services.tracing import record_consumption, sample_traceparent
from trainer.checkpoint import TrainState, export_hf, latest_checkpoint, load_checkpoint, save_checkpoint
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.leases import LeaseBook, LeaseSource, Work
from trainer.mismatch import check_mismatch
from trainer.parallel import DistEnv
from trainer.profiling import nvtx_ranges, step_profiler
from trainer.publishing import Background, Publisher, Publishing, adapter_gate, policy_weights, stage_senders
from trainer.stages import step_report

log = logging.getLogger(__name__)

# The ledger of samples trained and not yet acknowledged, in TrainState.extra (see trainer/leases.py).
LEDGER_KEY = "unacked_samples"
# What rank 0 hands every rank instead of a batch when a receiver fell behind while no batch came.
RESYNC = "resync"
# What rank 0 hands every rank instead of a batch when the trainer was asked to stop (SIGTERM): the loop ends as
# at its last step, so the weights it ended with are published, checkpointed and exported.
STOP = "stop"


def train(config: TrainerConfig, env: DistEnv, source: LeaseSource | None, publish: Publisher | None = None,
          stop: threading.Event | None = None) -> TrainState:
    """Train until config.max_steps optimizer steps, or until `stop` is set (rank 0's counts: trainer/run.py sets it on
    SIGTERM); resume from the latest checkpoint if any."""
    learner = Learner(config, env)
    state = resume(config, learner, env)
    book = None
    if env.is_main:
        book = LeaseBook(source, config.buffer.heartbeat_interval_s, ack_on_checkpoint=config.checkpoint.dir is not None,
                         ledger=state.extra.get(LEDGER_KEY))
    interrupted = False
    try:
        return _train(config, env, learner, state, book, publish, stop)
    except KeyboardInterrupt:  # Ctrl-C: stop now; acks retrying against a buffer already stopped held it 20 s
        interrupted = True
        raise
    finally:
        if book is not None:
            book.close(wait=not interrupted)


def _train(config: TrainerConfig, env: DistEnv, learner: Learner, state: TrainState, book: LeaseBook | None,
           publish: Publisher | None, stop: threading.Event | None) -> TrainState:
    publishing = env.broadcast_object(publish is not None)  # gathering weights is collective
    weights = policy_weights(learner, env, publish, config.publish) if publishing else None
    follower = stage_senders(env, publish, config.publish) if publishing else None
    publish_now = continue_versions(state, book, publish, env, config.publish.versions_above)
    if env.is_main:
        book.source.set_version(state.weight_version)
        book.checkpointed(state.weight_version)  # the resumed checkpoint holds its ledger's training: ack it
    publisher = Publishing(weights, publish, config.publish.overlap, env, config.publish.timeout_s + 60.0,
                           adapter_gate(learner, env, config.publish) if publishing else None, follower)
    if publishing and publish_now:
        publisher(state)
    pull_wait_s = config.buffer.max_wait_s + config.buffer.pull_timeout_s + 30.0  # the pull's own deadline + slack
    prefetch = Background("relayrl-prefetch")
    # Versions RESYNC added while the batch awaited was in flight: the same weights under new numbers, so no drift.
    # That pull's admission (its samples at most max_staleness behind) was judged at the version it was made at.
    resynced = 0
    clock = learner.stages  # every moment of this rank's loop is one stage's (trainer/stages.py)
    clock.ranges = nvtx_ranges(config.profile, env.device, capturing=False)  # None: no NVTX call (trainer/profiling.py)
    profiler = step_profiler(config.profile, env.rank, env.device, clock)  # None without profile.dir
    if profiler is not None:
        profiler.reported(state.step)
    while not _finished(config, state):
        started = time.monotonic()
        clock.switch("data_wait")
        work = None
        if env.is_main:  # the batch prefetched after the last step, else a pull now
            work = STOP if stop is not None and stop.is_set() else next_work(
                config, book, prefetch, publisher, pull_wait_s, state.weight_version, stop)
        work = env.broadcast_object(work)
        if work == STOP:
            log.info("asked to stop at step %d: publishing, checkpointing and exporting the weights it ended with",
                     state.step)
            break
        if work == RESYNC:  # the same weights under the next version: every receiver takes them
            state.weight_version += 1
            resynced += 1
            clock.switch("publish")
            publisher(state)
            continue
        if config.deterministic:  # sums over the batch (losses, gradients) add up in one order in every run
            work.train.sort(key=lambda sample: canonical_key(sample.group_id, sample.sample_id))
        steps_before = state.step
        training_ns = time.time_ns()
        if work.train:
            batch_stats = {
                **measure_staleness(work.train, state.weight_version - resynced, config.max_staleness),
                "reward_mean": sum(s.reward for s in work.train) / len(work.train),
                "failed": float(work.failed),
                "already_trained": float(len(work.already_trained)),
                "pull_s": time.monotonic() - started,
                "publish_s": publisher.seconds,
                **publisher.timings(),
            }
            clock.switch("forward")
            mini_batches = learner.prepare(work.train)
            for index, mini_batch in enumerate(mini_batches):
                clock.switch("forward")
                metrics = learner.train_step(mini_batch, state.step, state.weight_version - resynced)
                check_mismatch(config.mismatch, metrics, state.step)
                state.step += 1
                state.weight_version += 1
                last = index == len(mini_batches) - 1
                counters = book.counters() if env.is_main else {}
                stages = step_report(clock, env.device, env.distributed)  # collective: every rank's stages
                report(config, env, state, {**metrics, **batch_stats, **counters, "step_s": time.monotonic() - started,
                                            **stages}, work, last)
                if profiler is not None:
                    profiler.reported(state.step)
            state.samples_trained += len(work.train)
            if env.is_main:  # the step in each traced sample's trace (tracing off: nothing)
                record_consumption("trainer.step", [sample_traceparent(s.metadata) for s in work.train], training_ns,
                                   first_step=steps_before + 1, last_step=state.step)
        resynced = 0
        clock.switch("data_wait")
        if env.is_main:
            book.consumed(work, state.weight_version)
            if config.buffer.prefetch and not _finished(config, state) and not (stop is not None and stop.is_set()):
                prefetch.start(book.pull, config.batch.global_batch_size, state.weight_version)
        if publishing and _due(steps_before, state.step, config.publish.interval):
            clock.switch("publish")
            publisher(state)
            if env.is_main and publisher.sending is None:  # the engines' pause the trainer waited out
                clock.move(publisher.timings()["pause_s"], "publish", "pause")
        if config.checkpoint.dir and _due(steps_before, state.step, config.checkpoint.interval):
            clock.switch("checkpoint")
            checkpoint(config, learner, state, env, book)
    if publishing and env.broadcast_object(env.is_main and (publisher.published or 0) != state.weight_version):
        publisher(state)  # steps since the last publish (publish.interval > 1): the rollout serves what it ended with
    publisher.finish(state)
    if clock.ranges is not None:
        clock.ranges.close()
        clock.ranges = None
    if config.checkpoint.dir:
        checkpoint(config, learner, state, env, book)
    if config.checkpoint.export_dir:
        export_hf(config.checkpoint.export_dir, learner.policy, config.model_path, env)
    return state


def _finished(config: TrainerConfig, state: TrainState) -> bool:
    return config.max_steps is not None and state.step >= config.max_steps


def next_work(config: TrainerConfig, book: LeaseBook, prefetch: Background, publisher: Publishing,
              pull_wait_s: float, version: int, stop: threading.Event | None = None):
    """Rank 0: the next batch's work; RESYNC when, while no batch came, a receiver fell behind the last publish;
    STOP when `stop` was set meanwhile.

    A rollout worker that restarts serves its base weights at version 0. The trainer publishes after steps, and
    the driver admits no prompt while the worker lags the trainer by more than max_staleness: with nothing left
    in the buffer neither would ever move. So a wait for a batch checks the receivers every `publish.resync_s`.
    """
    if not prefetch.busy:
        prefetch.start(book.pull, config.batch.global_batch_size, version)
    resync_at = time.monotonic() + config.publish.resync_s
    while not prefetch.done(0.25):
        if stop is not None and stop.is_set():
            return STOP
        if time.monotonic() >= resync_at:
            resync_at = time.monotonic() + config.publish.resync_s
            if publisher.receivers_behind():
                return RESYNC
    return book.work(prefetch.wait(pull_wait_s))


def checkpoint(config: TrainerConfig, learner: Learner, state: TrainState, env: DistEnv, book: LeaseBook | None) -> None:
    """Save a checkpoint that records what is trained and not yet acked, then ack it (collective).

    Rank 0 writes it on the book's call thread, after the consumed marks of its steps and before its acks."""
    if env.is_main:
        book.flush()  # the last checkpoint's acks have settled: the ledger holds just what is trained and unacked
        state.extra[LEDGER_KEY] = book.ledger.entries()
    save_checkpoint(config.checkpoint.dir, learner.policy, learner.optimizer, state, env, config.checkpoint.keep_last,
                    submit=book.calls.submit if env.is_main else None)
    if env.is_main:
        book.checkpointed(state.weight_version)


def continue_versions(state: TrainState, book: LeaseBook | None, publish: Publisher | None, env: DistEnv,
                      used_before: int = 0) -> bool:
    """Continue the job's weight-version counter (collective); whether to publish the trainer's weights now.

    A trainer that starts from anything but the base weights at version 0 (a resumed checkpoint, or versions
    seen beyond its own: warm rollout workers, a buffer that outlived the last trainer, `used_before` by the
    job's earlier trainers) publishes what it holds under the next version above every one seen.
    """
    held = state.weight_version
    if env.is_main:
        served = getattr(publish, "served_versions", dict)()
        seen = {"checkpoint": held, "buffer": book.source.trainer_version(), "used before": used_before,
                **{f"receiver {address}": version for address, version in served.items() if version is not None}}
        known = max(seen.values())
        if state.step > 0 or known > held:
            state.weight_version = known + 1
            log.info("continuing weight versions at %d (seen: %s)", state.weight_version, seen)
    state.weight_version = env.broadcast_object(state.weight_version)
    return state.weight_version != held


def resume(config: TrainerConfig, learner: Learner, env: DistEnv) -> TrainState:
    """The state of the latest checkpoint (model and optimizer loaded), or a fresh start."""
    path = latest_checkpoint(config.checkpoint.dir)
    if path is None:
        return TrainState()
    state = load_checkpoint(path, learner.policy, learner.optimizer, env)
    log.info("resumed from %s at step %d (weight version %d)", path, state.step, state.weight_version)
    return state


def measure_staleness(samples: Sequence[Sample], trainer_version: int, max_staleness: int | None) -> dict[str, float]:
    """How many versions behind the trainer the batch's samples are; fails beyond max_staleness."""
    lags = [trainer_version - s.oldest_version for s in samples if s.oldest_version >= 0]
    worst = max(lags, default=0)
    if max_staleness is not None and worst > max_staleness:
        raise ValueError(
            f"the buffer handed out a sample {worst} versions old at trainer version {trainer_version} "
            f"(max_staleness={max_staleness})"
        )
    if lags and min(lags) < 0:  # versions are job-wide and only grow: a sample from a later version is a bug
        log.warning("a sample of weight version %d reached the trainer at version %d", trainer_version - min(lags),
                    trainer_version)
    return {"staleness_max": float(worst), "staleness_min": float(min(lags, default=0)),
            "staleness_mean": sum(lags) / len(lags) if lags else 0.0}


def report(
    config: TrainerConfig, env: DistEnv, state: TrainState, metrics: dict[str, float], work: Work, last: bool
) -> None:
    """Log one step (every log_interval) and append it to the metrics file (rank 0). With metrics_sample_ids,
    the last step of a batch records the ids it trained (and those it acked as trained before)."""
    if not env.is_main:
        return
    if config.metrics_path:
        record = {"step": state.step, "weight_version": state.weight_version, **metrics}
        if config.metrics_sample_ids:
            record.update(lease_id=work.lease_id, sample_ids=[s.sample_id for s in work.train] if last else [],
                          already_trained=work.already_trained if last else [])
        with open(Path(config.metrics_path), "a") as f:
            f.write(json.dumps(record) + "\n")
    if state.step % config.log_interval == 0 or state.step == config.max_steps:
        shown = " | ".join(f"{name} {value:.4g}" for name, value in sorted(metrics.items()))
        log.info("step %d/%s | %s", state.step, config.max_steps or "-", shown)


def _due(steps_before: int, steps_after: int, every: int) -> bool:
    """Whether a multiple of `every` was reached by the steps just taken."""
    return steps_after // every > steps_before // every
