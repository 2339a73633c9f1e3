"""Weight versions are one counter for the whole job: a fresh trainer and a resumed one, against the same
warm rollout worker, each land their first publish above what the worker serves; staleness is never negative;
a version refused as not newer is published again above the worker's, not logged and forgotten."""

import numpy as np
import pytest
import torch
from test_trainer_loop import BATCH, make_samples, put, records, stats

from protos import rollout_pb2, rollout_pb2_grpc
from services.client import connect_sync


def served_version(address: str) -> int:
    with connect_sync(address) as channel:
        return rollout_pb2_grpc.RolloutStub(channel).GetWeightVersion(rollout_pb2.GetWeightVersionRequest(),
                                                                      timeout=10).version


def put_generated_at(address: str, version: int, prefix: str) -> None:
    """What a driver puts: samples tagged with the version the worker served when it made them."""
    samples = make_samples(BATCH, prefix=prefix)
    for s in samples:
        s.weight_versions = np.full(s.response_ids.size, version, dtype=np.int64)
    put(address, samples)


def run_trainer(model, buffer: str, rollout: str, tmp_path, name: str, max_steps: int, checkpoints: str | None):
    from trainer.buffer_client import BufferClient
    from trainer.config import TrainerConfig
    from trainer.loop import train
    from trainer.parallel import init_distributed
    from trainer.run import RolloutPublisher

    config = TrainerConfig.model_validate({
        "model_path": str(model),
        "buffer": {"address": buffer, "max_wait_s": 30},
        "batch": {"global_batch_size": BATCH, "micro_batch_size": 4},
        "optim": {"lr": 1e-2},
        "max_steps": max_steps,
        "publish": {"receivers": [rollout], "timeout_s": 30},
        "metrics_path": str(tmp_path / f"{name}.jsonl"),
        "checkpoint": {"dir": checkpoints},
    })
    client, publisher = BufferClient(config.buffer), RolloutPublisher(config.publish)
    try:
        return train(config, init_distributed("cpu"), client, publisher), records(tmp_path / f"{name}.jsonl")
    finally:
        client.close()
        publisher.close()


def test_fresh_and_resumed_trainers_continue_the_versions_of_a_warm_worker(tiny_model_dir, tmp_path, service_factory):
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    rollout = service_factory("rollout", {"model": str(tiny_model_dir)})
    checkpoints = str(tmp_path / "checkpoints")

    put_generated_at(buffer.address, 0, "a")
    first, steps = run_trainer(tiny_model_dir, buffer.address, rollout.address, tmp_path, "first", 1, checkpoints)
    assert first.weight_version == served_version(rollout.address) == 1
    assert steps[0]["staleness_mean"] == 0  # each batch's samples are of one version: mean = min = max

    # A fresh trainer (no checkpoint) against the warm worker: its base weights go out above version 1 first.
    put_generated_at(buffer.address, 1, "b")
    fresh, steps = run_trainer(tiny_model_dir, buffer.address, rollout.address, tmp_path, "fresh", 1, None)
    assert steps[0]["staleness_mean"] == 2 - 1  # trained at version 2 on samples of version 1 (before: -1)
    assert (fresh.step, fresh.weight_version, served_version(rollout.address)) == (1, 3, 3)
    assert [r["weight_version"] for r in steps] == [3] and steps[0]["staleness_min"] == 1

    # The first trainer resumes from its checkpoint (step 1, version 1): it publishes that state as 4, trains 5.
    put_generated_at(buffer.address, 3, "c")
    resumed, steps = run_trainer(tiny_model_dir, buffer.address, rollout.address, tmp_path, "resumed", 2, checkpoints)
    assert (resumed.step, resumed.weight_version, served_version(rollout.address)) == (2, 5, 5)
    assert [r["weight_version"] for r in steps] == [5] and steps[0]["staleness_mean"] == steps[0]["staleness_min"] == 4 - 3
    assert stats(buffer.address).trainer_version == 5


def test_a_version_refused_as_not_newer_is_published_again_above_the_workers(tiny_model_dir, service_factory):
    from transformers import AutoModelForCausalLM

    from trainer.config.publish import PublishConfig
    from trainer.run import RolloutPublisher

    rollout = service_factory("rollout", {"model": str(tiny_model_dir)})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    weights = {name: t + 0.01 for name, t in model.state_dict().items()}
    publisher = RolloutPublisher(PublishConfig(receivers=[rollout.address], timeout_s=30))
    try:
        assert publisher(weights, 3) == 3 and served_version(rollout.address) == 3
        # A counter that is behind (a restarted trainer): the publish lands as the worker's version + 1.
        assert publisher(weights, 2) == 4 and served_version(rollout.address) == 4
        assert publisher.served_versions() == {rollout.address: 4}
    finally:
        publisher.close()


def restart_while_the_trainer_waits(model, tmp_path, service_factory, overlap: bool, staleness: int | None,
                                    late_version: int):
    """Train 2 steps: after the first, restart the worker while the buffer is empty (the trainer must publish again),
    then put a batch generated at `late_version`; the trainer's state, or the error it ended with."""
    import threading
    import time

    from trainer.buffer_client import BufferClient
    from trainer.config import TrainerConfig
    from trainer.loop import train
    from trainer.parallel import init_distributed
    from trainer.run import RolloutPublisher

    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "max_staleness": staleness})
    rollout = service_factory("rollout", {"model": str(model)})
    config = TrainerConfig.model_validate({
        "model_path": str(model), "buffer": {"address": buffer.address, "max_wait_s": 120},
        "batch": {"global_batch_size": BATCH, "micro_batch_size": 4}, "optim": {"lr": 1e-2}, "max_steps": 2,
        "max_staleness": staleness, "metrics_path": str(tmp_path / "metrics.jsonl"),
        "publish": {"receivers": [rollout.address], "timeout_s": 30, "resync_s": 0.5, "overlap": overlap},
    })
    client, publisher = BufferClient(config.buffer), RolloutPublisher(config.publish)
    result = {}

    def run() -> None:
        try:
            result["state"] = train(config, init_distributed("cpu"), client, publisher)
        except Exception as error:  # noqa: BLE001 - the test reads it
            result["error"] = error

    worker = threading.Thread(target=run)
    try:
        put_generated_at(buffer.address, 0, "a")
        worker.start()
        deadline = time.monotonic() + 60
        while served_version(rollout.address) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert served_version(rollout.address) == 1
        rollout.restart()  # back at its base weights, version 0; nothing in the buffer
        deadline = time.monotonic() + 30
        while served_version(rollout.address) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert served_version(rollout.address) == 2  # the trainer's weights again, under the next version
        put_generated_at(buffer.address, late_version, "b")
        worker.join(120)
        assert not worker.is_alive()
        return result.get("state") or result["error"]
    finally:
        worker.join(1)
        client.close()
        publisher.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_restarted_worker_gets_the_weights_while_the_trainer_waits_for_a_batch(tiny_model_dir, tmp_path,
                                                                                service_factory, overlap):
    """A rollout worker that restarts serves version 0; with the buffer empty no step (and so no publish)
    comes, and the driver admits nothing for a worker that far behind: the trainer must publish again. With
    `publish.overlap` too: the last step's publish ran on its thread and ended, its outcome not yet collected."""
    state = restart_while_the_trainer_waits(tiny_model_dir, tmp_path, service_factory, overlap, None, 2)
    assert state.step == 2


def test_a_batch_pulled_before_a_resync_is_judged_at_the_version_it_was_pulled_at(tiny_model_dir, tmp_path,
                                                                                 service_factory):
    """CI's netns run (2026-12-07) failed here: the pull after step 1 was made at version 1 (max_staleness 1 admits
    version 0); while it waited, the worker was republished the same weights as version 2, and the batch that then
    came was judged 2 versions old: "the buffer handed out a sample 2 versions old". No weights changed in between."""
    state = restart_while_the_trainer_waits(tiny_model_dir, tmp_path, service_factory, False, 1, 0)
    assert not isinstance(state, Exception), state
    assert state.step == 2
    assert [r["staleness_max"] for r in records(tmp_path / "metrics.jsonl")] == [0, 1]


def test_a_resumed_trainer_continues_above_the_versions_the_job_used_before():
    # A whole job killed and resumed: its rollout is new (version 0) and the buffer heard of version 5 only, but
    # the killed trainer had stepped to version 7 and published it: the next version is 8, not 6.
    from types import SimpleNamespace

    from trainer.checkpoint import TrainState
    from trainer.loop import continue_versions
    from trainer.parallel import init_distributed

    book = SimpleNamespace(source=SimpleNamespace(trainer_version=lambda: 5))
    state = TrainState(step=5, weight_version=5)
    assert continue_versions(state, book, None, init_distributed("cpu"), used_before=7)
    assert state.weight_version == 8
    fresh = TrainState()
    assert not continue_versions(fresh, SimpleNamespace(source=SimpleNamespace(trainer_version=lambda: -1)), None,
                                 init_distributed("cpu"))
    assert fresh.weight_version == 0
