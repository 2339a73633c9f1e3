"""How the training loop publishes: the weights each publish sends, and one publish that may run while the next
step computes (`publish.overlap`); `Background` runs one call at a time on a thread (the overlapped publish, and the
loop's prefetched pull). With pipeline stages every stage's first rank sends its own layers (`stage_senders`,
trainer/broadcast/senders.py): rank 0 publishes, the others follow its publish.
"""

import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future

import torch

from services.device import transfer_backend
from trainer.adapter_publish import AdapterGate, AdapterWeights
from trainer.broadcast.config import BroadcastConfig
from trainer.broadcast.gather import ShardedWeights, finish_gather, publish_dtype
from trainer.broadcast.senders import Peers, SenderGroup, StageSender
from trainer.checkpoint import TrainState, hf_state_dict, ties_embeddings
from trainer.config.publish import PublishConfig
from trainer.learner import Learner
from trainer.lora import has_lora
from trainer.parallel import DistEnv, gather_model_state, stage_model_state

log = logging.getLogger(__name__)

# publish(named_tensors, version) -> the version the receivers serve now (None: not known, e.g. no receivers):
# hand new weights (Hugging Face names) to the rollout side. It may publish under a higher version than asked
# when the receivers refuse `version` as not newer (RolloutPublisher); the trainer's counter follows.
Publisher = Callable[[dict[str, torch.Tensor], int], int | None]


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

    def done(self, timeout_s: float) -> bool:
        """Whether the call in flight has finished, waiting up to `timeout_s` for it (True when none is)."""
        return self._future is None or not futures.wait([self._future], timeout_s).not_done

    def wait(self, timeout_s: float):
        """The call's result (its exception is raised here); None when nothing is in flight."""
        future, self._future = self._future, None
        return None if future is None else future.result(timeout_s)


class Publishing:
    """Publishes the policy as weight versions (collective); one overlapped publish may be in flight.

    A publish that landed under a higher version than asked (the receivers refused it as not newer) moves the
    trainer's counter by as much, on every rank.
    """

    def __init__(self, weights: Callable[[], dict[str, torch.Tensor] | ShardedWeights] | None, publish: Publisher | None,
                 overlap: bool, env: DistEnv, wait_s: float, gate: Callable[[], bool] | None = None,
                 follower: StageSender | None = None) -> None:
        self.weights, self.publish, self.env, self.wait_s = weights, publish, env, wait_s
        self.follower = follower  # pipeline stage s > 0's first rank: it sends its own layers in rank 0's publish
        # LoRA (trainer/adapter_publish.py): whether the adapter moved since the last publish (collective); a step
        # that did not move it publishes nothing, and its version is the last published one (same weights).
        self.gate = gate
        self.skipped = 0
        self._behind = False  # rank 0: receivers_behind() found a receiver behind: the next publish goes regardless
        self.sending = Background("relayrl-publish") if overlap and (env.is_main or follower) else None
        self._requested = 0
        self.published: int | None = None  # the version the last publish went out as (rank 0)
        self.seconds = 0.0  # the last publish's duration, reported with the steps after it

    def __call__(self, state: TrainState) -> None:
        started = time.monotonic()
        self._wait(state)  # the previous overlapped publish, if any
        if self.gate is not None:
            force, published = self.env.broadcast_object((self._behind, self.published))
            self._behind = False
            if not self.gate() and not force and published is not None:
                state.weight_version = published
                self.skipped += 1
                return
        tensors = self.weights()
        try:
            if self.env.is_main:
                if self.sending is not None:
                    self._requested = state.weight_version
                    self.sending.start(self.publish, tensors, state.weight_version)
                else:
                    self._adopt(state, state.weight_version, self.publish(tensors, state.weight_version))
                self.published = state.weight_version
            elif self.follower is not None:
                if self.sending is not None:
                    self.sending.start(self.follower.follow, tensors)
                else:
                    self.follower.follow(tensors)
        finally:  # sharded weights: the other ranks gather every tensor now, rank 0 what its publish did not reach
            finish_gather(tensors)
        state.weight_version = self.env.broadcast_object(state.weight_version)
        self.seconds = time.monotonic() - started

    def timings(self) -> dict[str, float]:
        """Rank 0: the last publish that ended: sync_s, from BeginUpdate until every receiver switched, and pause_s,
        the longest an engine generated nothing for it (zeros before the first, or from a publisher that does not
        say). publish_s is what the publish cost this loop: all of sync_s, or with `overlap` the gather alone."""
        return {"sync_s": 0.0, "pause_s": 0.0, **getattr(self.publish, "timings", {})}

    def receivers_behind(self) -> bool:
        """Rank 0, no publish in flight: whether a receiver serves an older version than the last publish.

        An overlapped publish that has ended is not in flight, though its outcome is collected only at the next
        publish: the one after the last step (failed, say, while a receiver's host was unreachable) ends before a
        wait for a batch that may never come unless that receiver gets the weights again."""
        if self.published is None or (self.sending is not None and not self.sending.done(0)):
            return False
        served = getattr(self.publish, "served_versions", dict)()
        behind = {address: v for address, v in served.items() if v is not None and v < self.published}
        self._behind = bool(behind)
        if behind:
            log.warning("receivers %s serve older versions than %d (restarted?): publishing again", behind,
                        self.published)
        return bool(behind)

    def finish(self, state: TrainState) -> None:
        """Wait for an overlapped publish still in flight (collective)."""
        self._wait(state)
        if self.follower is not None:
            self.follower.close(self.wait_s)
        state.weight_version = self.env.broadcast_object(state.weight_version)

    def _wait(self, state: TrainState) -> None:
        if self.sending is not None and self.sending.busy:
            landed = self.sending.wait(self.wait_s)
            self._adopt(state, self._requested, landed)
            if landed is not None and landed > self._requested:
                self.published = landed

    @staticmethod
    def _adopt(state: TrainState, requested: int, landed: int | None) -> None:
        if landed is not None and landed > requested:
            log.warning("weight version %d landed as %d: trainer versions move on by %d", requested, landed,
                        landed - requested)
            state.weight_version += landed - requested


def policy_weights(
    learner: Learner, env: DistEnv, publish: Publisher | None, config: PublishConfig
) -> Callable[[], dict[str, torch.Tensor] | ShardedWeights]:
    """What each publish sends: the policy under Hugging Face names (collective).

    A trainer that holds its policy whole (one process) and sends it uncast binds the parameters to the
    broadcast's layout (`publish.bind`, see PublishConfig.bind): each publish then goes straight from their
    memory, or, overlapped with the next step, from a one-copy snapshot of it. Otherwise each publish sends
    ShardedWeights over the policy's state as this rank holds it (FSDP2 shards): every tensor is gathered on the
    trainer's device straight into its bucket as the bucket goes out (trainer/broadcast/gather.py), never into
    a state dict in host memory. Overlapped with the next step, the publish cannot gather while that step runs
    its own collectives: every tensor is gathered first, on the device, into a copy (the model's size, on rank 0).
    """
    if has_lora(learner.policy):  # the base once, then the adapter (trainer/adapter_publish.py)
        return AdapterWeights(learner.policy, env, publish_dtype(config.dtype))
    tied = ties_embeddings(learner.policy)
    can_bind = not env.distributed and config.bind and config.dtype is None
    if can_bind and hasattr(publish, "bind"):
        parameters = hf_state_dict(dict(learner.policy.named_parameters()), tied)
        if set(parameters) == set(hf_state_dict(learner.policy.state_dict(), tied)):
            publish.bind(parameters)
            return publish.snapshot if config.overlap else lambda: parameters
        log.info("publishing gathered state dicts: the policy's state holds tensors that are not parameters")
    dtype = publish_dtype(config.dtype)
    if env.pp_size > 1:  # pipeline stages: each stage's first rank sends its own layers, or rank 0 all of them
        cast = (lambda t: t.to(dtype) if dtype is not None and t.is_floating_point() else t)
        state = stage_model_state if stages_send(env, config) else gather_model_state
        return lambda: {name: cast(t) for name, t in hf_state_dict(state(learner.policy, env), tied).items()}

    def sharded() -> ShardedWeights:
        return ShardedWeights(hf_state_dict(learner.policy.state_dict(), tied), env.device, dtype)

    if config.overlap:
        return lambda: sharded().gathered_copy(keep=env.is_main)
    return sharded


def stages_send(env: DistEnv, config: PublishConfig) -> bool:
    """Whether each pipeline stage sends its own layers (several senders: over gloo, whole versions, for now);
    otherwise (one stage, NCCL, delta sync) rank 0 sends everything, every stage's tensors gathered to it first."""
    backend = transfer_backend(env.device) if config.backend == "auto" else config.backend
    return env.pp_size > 1 and backend == "gloo" and config.delta == "off"


def stage_senders(env: DistEnv, publish: Publisher | None, config: PublishConfig) -> StageSender | None:
    """When the stages send their own layers (`stages_send`; collective: every rank, before the first publish): the
    senders' group, rank 0's publisher made to publish from every stage (`use_senders`), and stage s's first rank's
    StageSender, which the loop's Publishing runs in each of rank 0's publishes; None on the other ranks, and
    otherwise."""
    if not stages_send(env, config):
        return None
    bound = BroadcastConfig(timeout_s=config.timeout_s, control_timeout_s=config.control_timeout_s).publish_bound_s
    group = SenderGroup(env.mesh.mesh, env.rank, timeout_s=2 * bound + 60.0)
    if env.is_main:
        if not hasattr(publish, "use_senders"):
            raise ValueError("parallel.pp > 1: each stage sends its own layers, which this publisher cannot take")
        publish.use_senders(Peers(group))
        return None
    return StageSender(group, BroadcastConfig(dtype=config.dtype)) if group.index is not None else None


def adapter_gate(learner: Learner, env: DistEnv, config: PublishConfig) -> Callable[[], bool] | None:
    """A LoRA policy's publish gate (AdapterGate.moved); None for a policy without adapters."""
    if not has_lora(learner.policy):
        return None
    return AdapterGate(learner.policy, env, config.adapter_min_change).moved
