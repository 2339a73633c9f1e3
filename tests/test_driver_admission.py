"""Admission control reads what the trainer consumes; producer ids stay unique across driver restarts, and a
restarted driver goes on from its saved position.

The rule (rollout/driver/admission.py) on its own, then the Driver against real buffer, reward and rollout
processes, with a stand-in trainer that pulls, acks and publishes weights the way trainer/loop.py does.
"""

import asyncio
import itertools
import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest
import yaml
from safetensors.torch import load_file

from deploy.experiment.tasks import arithmetic_tasks, write_jsonl
from protos import buffer_pb2, buffer_pb2_grpc
from protos.sample import Sample
from rollout.driver.admission import Pipeline, admit, expected_lag
from rollout.driver.driver import Driver, DriverConfig, load_prompts
from rollout.driver.position import Position
from rollout.driver.producer import STOP_GRACE_S, item_stream
from services.client import connect

G, B = 8, 64  # group size, batch size (8 groups)


def test_mini_batches_advance_the_trainer_several_versions_per_batch():
    # The second batch from now trains 2 versions later with mini_batches=2, 1 version with 1.
    second_batch = Pipeline(trainer_version=4, served_version=4, queued=B - G + 1)
    assert admit(second_batch, G, B, versions_per_batch=1, max_staleness=1)
    assert expected_lag(second_batch, G, B, versions_per_batch=2) == 2
    assert not admit(second_batch, G, B, versions_per_batch=2, max_staleness=1)
    assert admit(Pipeline(4, 4, queued=B - G), G, B, versions_per_batch=2, max_staleness=1)


def test_a_rollout_behind_the_trainer_admits_only_what_the_lag_allows():
    # Publishing every k steps: the served version trails the trainer's.
    assert not admit(Pipeline(trainer_version=6, served_version=4, queued=0), G, B, 1, max_staleness=1)
    assert admit(Pipeline(6, 5, queued=0), G, B, 1, max_staleness=1)
    assert not admit(Pipeline(6, 5, queued=B), G, B, 1, max_staleness=1)
    assert admit(Pipeline(6, 5, queued=B), G, B, 1, max_staleness=2)


def test_dropped_groups_and_restarts_count_only_what_is_queued():
    # Whatever the driver started before (dropped groups, an earlier driver process), only what is
    # queued decides: an empty pipeline admits, a full one does not.
    assert admit(Pipeline(trainer_version=50, served_version=50, queued=0), G, B, 1, max_staleness=0)
    assert not admit(Pipeline(0, 0, queued=2 * B), G, B, 1, max_staleness=1)
    assert admit(Pipeline(0, 0, queued=2 * B - G), G, B, 1, max_staleness=1)
    # max_staleness 0: one batch's worth at a time.
    assert admit(Pipeline(3, 3, queued=B - G), G, B, 1, max_staleness=0)
    assert not admit(Pipeline(3, 3, queued=B - G + 1), G, B, 1, max_staleness=0)


# ---------------------------------------------------------------- against real services

GROUP, GROUPS_PER_BATCH = 4, 2
BATCH = GROUP * GROUPS_PER_BATCH


@pytest.fixture
def pipeline(tmp_path, service_factory, tiny_model_dir):
    engine = {"engine.torch_threads": 1, "engine.max_model_len": 64}
    rollout = service_factory("rollout", {"model": str(tiny_model_dir), **engine})
    reward = service_factory("reward", {})
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "max_staleness": 1})
    prompts = write_jsonl(arithmetic_tasks(digits=1), tmp_path / "prompts.jsonl")

    def config(**overrides) -> DriverConfig:
        return DriverConfig.model_validate({
            "rollout": rollout.address, "reward": reward.address, "buffer": buffer.address,
            "prompts": str(prompts), "tokenizer": str(tiny_model_dir), "group_size": GROUP,
            "groups_per_batch": GROUPS_PER_BATCH, "max_staleness": 1, "max_tokens": 4, "concurrency": 8,
            **overrides})

    return config, buffer, rollout, tiny_model_dir


async def run_driver(config: DriverConfig, seconds: float | None = None) -> Driver:
    """Run a driver to its max_groups, or for `seconds`; returns it (stats, groups started)."""
    driver = Driver(config)
    stop = asyncio.Event()
    try:
        task = asyncio.create_task(driver.run(load_prompts(config), stop))
        if seconds is None:
            await asyncio.wait_for(task, 120)
        else:
            await asyncio.sleep(seconds)
            stop.set()
            await asyncio.wait_for(task, 60)
    finally:
        await driver.close()
    return driver


async def buffer_stats(address: str) -> buffer_pb2.StatsResponse:
    async with connect(address) as channel:
        return await buffer_pb2_grpc.BufferStub(channel).Stats(buffer_pb2.StatsRequest(), timeout=10)


def test_a_signalled_driver_stops_within_seconds_when_the_buffer_is_gone(pipeline, tmp_path):
    """Ctrl-C reaches every process of a job at once: a driver process whose calls went to a buffer already gone
    retried them for minutes after the signal (until the job killed it). Now its groups get STOP_GRACE_S."""
    config, buffer, _, _ = pipeline
    path = tmp_path / "driver.yaml"
    path.write_text(yaml.safe_dump(config(max_staleness=100).model_dump(mode="json")))
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    driver = subprocess.Popen([sys.executable, "-m", "rollout.driver", "--config", str(path)], env=env, cwd=root,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while asyncio.run(buffer_stats(buffer.address)).accepted == 0:
            assert driver.poll() is None and time.monotonic() < deadline, "the driver stored nothing"
            time.sleep(0.2)
        buffer.kill()
        time.sleep(1.0)  # its Stats and Put calls now fail and are retried
        signalled = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(30) == 0
        assert time.monotonic() - signalled < STOP_GRACE_S + 4
    finally:
        driver.kill()
        driver.wait()


def test_a_restarted_driver_with_the_same_seed_gets_its_samples_stored(pipeline):
    config, buffer, _, _ = pipeline

    async def main():
        # max_staleness high: nothing consumes here, and admission is not what this test is about.
        first = await run_driver(config(max_groups=3, max_staleness=100))
        second = await run_driver(config(max_groups=3, max_staleness=100))
        return first, second, await buffer_stats(buffer.address)

    first, second, stats = asyncio.run(main())
    assert first.stats["accepted"] == second.stats["accepted"] == 3 * GROUP
    assert second.stats["duplicates"] == 0 and stats.duplicates == 0
    assert stats.accepted == 6 * GROUP
    assert first.producer_id != second.producer_id


def test_a_restarted_driver_goes_on_from_its_position(pipeline, tmp_path):
    config, buffer, _, _ = pipeline
    position = tmp_path / "driver_position.json"

    async def main():
        first = await run_driver(config(max_groups=3, max_staleness=100, position_path=str(position)))
        second = await run_driver(config(max_groups=3, max_staleness=100, position_path=str(position)))
        return first, second, await drain_group_ids(buffer.address, 6 * GROUP)

    first, second, group_ids = asyncio.run(main())
    prompts = load_prompts(config())
    expected = [p.prompt_id for p in itertools.islice(item_stream(prompts, 0), 6)]
    # Group ids are PROMPT#PRODUCER.INDEX: the second driver ran the stream's groups 3-5, not 0-2 again.
    indices = sorted((int(g.rsplit(".", 1)[1]), g.split("#")[0]) for g in group_ids)
    assert indices == list(enumerate(expected))
    assert first.producer_id != second.producer_id
    assert Position.load(position).next_index == 6


async def drain_group_ids(address: str, samples: int) -> set[str]:
    """Lease (and never ack) `samples` samples; the ids of their groups."""
    group_ids: set[str] = set()
    async with connect(address) as channel:
        stub = buffer_pb2_grpc.BufferStub(channel)
        async for batch in stub.Pull(buffer_pb2.PullRequest(batch_size=samples, max_batches=1, lease_timeout_s=600),
                                     timeout=10):
            group_ids |= {s.group_id for s in batch.samples}
    return group_ids


def test_a_restarted_driver_admits_nothing_while_the_buffer_holds_enough(pipeline):
    config, buffer, _, _ = pipeline

    async def main():
        first = await run_driver(config(), seconds=6)  # fills the pipeline: 2 batches at max_staleness 1
        held = (await buffer_stats(buffer.address))
        second = await run_driver(config(), seconds=3)
        return first, held, second

    first, held, second = asyncio.run(main())
    assert (first.groups_started, held.pending) == (2 * GROUPS_PER_BATCH, 2 * BATCH), (first.stats, held)
    assert second.groups_started == 0, "a restarted driver ran ahead of what the buffer already holds"


async def stand_in_trainer(buffer_address: str, rollout_address: str, weights: dict, batches: int,
                           versions_per_batch: int, publish_every: int) -> list[int]:
    """Pull, 'train' (a pause), ack with the advanced version, publish every k batches (as trainer/loop.py).

    Returns the lag of each batch: the trainer's version minus its samples' oldest version.
    """
    from trainer.broadcast.broadcaster import WeightBroadcaster

    lags, version = [], 0
    async with connect(buffer_address) as channel, WeightBroadcaster([rollout_address]) as broadcaster:
        stub = buffer_pb2_grpc.BufferStub(channel)
        for index in range(batches):
            request = buffer_pb2.PullRequest(batch_size=BATCH, max_batches=1, lease_timeout_s=60)
            batch = None
            async for batch in stub.Pull(request, timeout=60):
                pass
            samples = [Sample.from_proto(s) for s in batch.samples]
            lags.append(batch.trainer_version - min(s.oldest_version for s in samples))
            await asyncio.sleep(0.3)
            version += versions_per_batch
            await stub.Ack(buffer_pb2.AckRequest(lease_id=batch.lease_id, trainer_version=version), timeout=10)
            if (index + 1) % publish_every == 0:
                report = await broadcaster.publish(weights, version)
                assert report.ok, report.failed
    return lags


@pytest.mark.parametrize("versions_per_batch, publish_every", [(2, 1), (1, 2)], ids=["mini_batches=2", "publish/2"])
def test_admission_keeps_every_batch_within_max_staleness(pipeline, versions_per_batch, publish_every):
    config, buffer, rollout, model_dir = pipeline
    weights = load_file(model_dir / "model.safetensors")

    async def main():
        driver = Driver(config(versions_per_batch=versions_per_batch))
        stop = asyncio.Event()
        running = asyncio.create_task(driver.run(load_prompts(driver.config), stop))
        try:
            lags = await asyncio.wait_for(
                stand_in_trainer(buffer.address, rollout.address, weights, 8, versions_per_batch, publish_every), 150)
        finally:
            stop.set()
            await asyncio.wait_for(running, 60)
            await driver.close()
        return lags, await buffer_stats(buffer.address), driver

    try:
        lags, stats, driver = asyncio.run(main())
    except (TimeoutError, grpc.aio.AioRpcError) as exc:
        pytest.fail(f"the stand-in trainer starved: {exc!r}")
    assert max(lags) <= 1, f"lags {lags} beyond max_staleness 1"
    assert stats.dropped.get("stale", 0) == 0, f"the buffer dropped {dict(stats.dropped)}"
    assert driver.gauge.polls > 0


def test_a_paused_producer_polls_again_the_moment_a_newer_version_is_served():
    """The Gauge's pause ends when its watch reports a newer version (GetWeightVersion with wait_s), not at the
    next poll; a watch that ends without one (timed out, failed) leaves the poll interval in charge. A poll
    is told the version a watch proves (one waiting on v: v is served; one that answered: its answer), so it
    need not ask the rollout."""
    import time

    from rollout.driver.admission import Gauge

    hints = []

    async def main():
        served = {"version": 4}
        landed = asyncio.Event()

        async def poll(known):
            hints.append(known)
            return 4, served["version"] if known is None else known, 0

        async def watch(above: int) -> int:
            await landed.wait()
            return served["version"]

        gauge = Gauge(poll, poll_s=10.0, watch=watch)
        await gauge.read(0)

        async def land_weights():
            await asyncio.sleep(0.2)
            served["version"] = 5
            landed.set()

        started = time.monotonic()
        await asyncio.gather(gauge.pause(), land_weights())
        woke_after_s = time.monotonic() - started
        reading = await gauge.read(0)  # polls at once: the pause was ended by new weights

        async def failing_watch(above: int) -> int:
            raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, "rollout restarting")

        quiet = Gauge(poll, poll_s=0.3, watch=failing_watch)
        await quiet.read(0)
        started = time.monotonic()
        await quiet.pause()
        failed_watch_pause_s = time.monotonic() - started
        await quiet.read(0)  # the watch failed: the poll asks

        async def waiting_watch(above: int) -> int:
            await asyncio.Event().wait()

        waiting = Gauge(poll, poll_s=0.1, watch=waiting_watch)
        await waiting.read(0)
        await waiting.pause()  # the poll interval ends it; the watch on version 5 still waits
        await waiting.read(0)
        for one in (gauge, quiet, waiting):
            one.close()
        return woke_after_s, reading, gauge.polls, gauge.wakeups, failed_watch_pause_s

    woke_after_s, reading, polls, wakeups, failed_watch_pause_s = asyncio.run(main())
    assert 0.15 <= woke_after_s < 2.0 and wakeups == 1
    assert reading.served_version == 5 and polls == 2
    assert 0.25 <= failed_watch_pause_s < 2.0
    assert hints == [None, 5, None, None, None, 5]
