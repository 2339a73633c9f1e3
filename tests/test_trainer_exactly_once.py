"""Leases and exactly-once against a real buffer process: a step slower than the lease, a FAILED group
member, a trainer SIGKILLed between checkpoints, a buffer SIGKILLed and restarted under a running trainer.

The audit of the crash tests: the final model's history is each incarnation's step records up to the
checkpoint the next one resumed from; what the buffer acknowledged is every sample put minus what it still
holds (drained at the end). Every acknowledged sample must appear exactly once in that history."""

import signal
import time

import pytest
from test_trainer_loop import (
    BATCH,
    GROUP,
    make_samples,
    put,
    records,
    start_trainer,
    stats,
    trainer_overrides,
)

from protos import buffer_pb2, buffer_pb2_grpc
from protos.sample import SampleStatus
from services.client import connect_sync


def drain(address: str) -> set[str]:
    """Lease (and never ack) everything the buffer still holds; their ids."""
    held = stats(address)
    assert held.leased == 0, held
    ids: set[str] = set()
    with connect_sync(address) as channel:
        stub = buffer_pb2_grpc.BufferStub(channel)
        while len(ids) < held.pending:
            request = buffer_pb2.PullRequest(batch_size=GROUP, max_batches=1, lease_timeout_s=600)
            for batch in stub.Pull(request, timeout=10):
                ids |= {s.sample_id for s in batch.samples}
    return ids


def lineage(runs: list[list[dict]]) -> list[dict]:
    """The final model's steps: each run's records up to the step the next run resumed from."""
    steps: list[dict] = []
    for run, following in zip(runs, [*runs[1:], None]):
        resumed_from = following[0]["step"] - 1 if following else float("inf")
        steps = [r for r in steps if r["step"] <= run[0]["step"] - 1] + [r for r in run if r["step"] <= resumed_from]
    return steps


def assert_exactly_once(history: list[dict], all_ids: set[str], address: str, everything_acked: bool) -> None:
    assert [r["step"] for r in history] == list(range(1, len(history) + 1))
    trained = [sample_id for r in history for sample_id in r["sample_ids"]]
    assert len(trained) == len(set(trained)), "a sample was trained twice in the final model's history"
    acked = all_ids - drain(address)
    assert acked <= set(trained), f"acked but never trained in the final model's history: {sorted(acked - set(trained))[:8]}"
    if everything_acked:
        assert acked == set(trained)


def train_from_buffer(model, address: str, tmp_path, client_class=None, publish=None, buffer=None, **fields):
    """Train the tiny model from the buffer at `address` through a real BufferClient (or `client_class`, a
    subclass); step records with sample ids in tmp_path/metrics.jsonl. Returns the final TrainState."""
    from trainer.buffer_client import BufferClient
    from trainer.config import TrainerConfig
    from trainer.loop import train
    from trainer.parallel import init_distributed

    config = TrainerConfig.model_validate({
        "model_path": str(model),
        "buffer": {"address": address, **(buffer or {})},
        "batch": {"global_batch_size": BATCH, "micro_batch_size": 4},
        "metrics_path": str(tmp_path / "metrics.jsonl"),
        "metrics_sample_ids": True,
        **fields,
    })
    client = (client_class or BufferClient)(config.buffer)
    try:
        return train(config, init_distributed("cpu"), client, publish)
    finally:
        client.close()


def test_a_step_slower_than_the_lease_is_neither_redelivered_nor_fatal(tiny_model_dir, tmp_path, service_factory):
    """Publishing takes 5 s, the lease 2 s: the heartbeat keeps the trained lease (held until the checkpoint)
    and the prefetched one open. Before, the prefetched lease expired and its Ack failed NOT_FOUND."""
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "lease_timeout_s": 2.0})
    put(buffer.address, make_samples(3 * BATCH))
    published = []

    def slow_publish(named_tensors, version):
        time.sleep(5.0)
        published.append(version)
        return version

    state = train_from_buffer(tiny_model_dir, buffer.address, tmp_path, publish=slow_publish,
                              buffer={"max_wait_s": 30, "lease_timeout_s": 2.0}, max_steps=2,
                              checkpoint={"dir": str(tmp_path / "checkpoints"), "interval": 1})
    after = stats(buffer.address)
    assert (state.step, published) == (2, [1, 2])
    assert (after.redelivered, after.acked, after.leased, after.pending) == (0, 2 * BATCH, 0, BATCH)
    trained = [i for r in records(tmp_path / "metrics.jsonl") for i in r["sample_ids"]]
    assert len(trained) == len(set(trained)) == 2 * BATCH


def test_a_prefetch_pulled_before_the_version_report_lands_gets_no_sample_beyond_max_staleness(
        tiny_model_dir, tmp_path, service_factory):
    """The prefetch after step k pulls while the report of version k (an ack here, a consumed mark with
    checkpoints) is still on its way; the buffer used to filter by the version before and hand out a sample
    max_staleness + 1 behind, and the trainer stopped: "the buffer handed out a sample 2 versions old". The
    pull now carries the version: that batch is dropped as stale and the next one trains."""
    import numpy as np

    from trainer.buffer_client import BufferClient

    class SlowReports(BufferClient):  # the real client, its version reports 1 s late (a busy call thread)
        def ack(self, lease_id, trainer_version=None):
            time.sleep(1.0)
            return super().ack(lease_id, trainer_version)

        def extend(self, lease_ids, consumed=False, trainer_version=None):
            if trainer_version is not None:
                time.sleep(1.0)
            return super().extend(lease_ids, consumed, trainer_version)

    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "max_staleness": 1})
    batches = [make_samples(BATCH, prefix) for prefix in "abcd"]  # a, b, c: version 0; d: version 1
    for sample in batches[3]:
        sample.weight_versions = np.ones_like(sample.weight_versions)
    for batch in batches:
        put(buffer.address, batch)
    state = train_from_buffer(tiny_model_dir, buffer.address, tmp_path, client_class=SlowReports,
                              buffer={"max_wait_s": 20, "lease_timeout_s": 30.0}, max_steps=3, max_staleness=1)
    steps = records(tmp_path / "metrics.jsonl")
    assert state.step == 3
    assert [{i[0] for i in r["sample_ids"]} for r in steps] == [{"a"}, {"b"}, {"d"}]
    assert [r["staleness_max"] for r in steps] == [0, 1, 1]
    assert stats(buffer.address).dropped["stale"] == BATCH


def test_a_failed_group_member_is_counted_and_training_proceeds(tiny_model_dir, tmp_path, service_factory):
    """One group loses a member to FAILED (dropped at Put): its whole-group batch is short, and trains."""
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    samples = make_samples(3 * BATCH)
    samples[1].status, samples[1].reason = SampleStatus.FAILED, "reward timeout"
    put(buffer.address, samples)
    state = train_from_buffer(tiny_model_dir, buffer.address, tmp_path,
                              buffer={"max_wait_s": 10, "lease_timeout_s": 5.0}, max_steps=3)
    steps = records(tmp_path / "metrics.jsonl")
    # FIFO, whole groups: the short group and the next one (7 samples), then two full groups at a time.
    assert state.step == 3 and [r["samples"] for r in steps] == [2 * GROUP - 1, BATCH, BATCH]
    assert "s1" not in {i for r in steps for i in r["sample_ids"]}
    after = stats(buffer.address)
    assert after.dropped["failed"] == 1 and after.acked == 3 * BATCH - 1 and after.pending == 0


def test_failed_samples_that_reach_the_trainer_are_counted_never_trained(tiny_model_dir):
    from trainer.leases import LeaseBook

    class OneBatch:
        def pull(self, batch_size, trainer_version=None):
            from trainer.buffer_client import LeasedBatch

            samples = make_samples(BATCH)
            samples[2].status = SampleStatus.FAILED
            return LeasedBatch("lease-1", samples, 0)

        def extend(self, lease_ids, consumed=False, trainer_version=None):
            return []

    book = LeaseBook(OneBatch(), interval_s=60, ack_on_checkpoint=True)
    try:
        work = book.work(book.pull(BATCH))
    finally:
        book.close()
    assert work.failed == 1 and len(work.train) == BATCH - 1 and "s2" not in {s.sample_id for s in work.train}


def test_a_lost_lease_is_redelivered_and_acked_without_training_again(tmp_path, service_factory):
    """A consumed lease expires before its checkpoint (a frozen trainer): the Ack answers NOT_FOUND, counted
    as redelivered; the same samples come again and are acked without being trained twice."""
    from trainer.buffer_client import BufferClient
    from trainer.config.buffer import BufferClientConfig
    from trainer.leases import LeaseBook

    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    put(buffer.address, make_samples(BATCH))
    client = BufferClient(BufferClientConfig(address=buffer.address, lease_timeout_s=1.0, max_wait_s=10))
    book = LeaseBook(client, interval_s=60, ack_on_checkpoint=True)  # no heartbeat within this test
    try:
        first = book.work(book.pull(BATCH))
        assert len(first.train) == BATCH
        book.consumed(first, trainer_version=1)
        book.flush()  # the marks and acks run on the book's call thread
        held = stats(buffer.address)
        assert (held.leased, held.consumed, held.trainer_version) == (BATCH, BATCH, 1)  # trained, awaiting a checkpoint
        time.sleep(1.5)
        book.checkpointed(trainer_version=1)
        book.flush()  # the marks and acks run on the book's call thread
        assert (book.redelivered, book.acked, len(book.ledger)) == (1, 0, BATCH)
        again = book.work(book.pull(BATCH))
        assert again.train == [] and sorted(again.already_trained) == sorted(s.sample_id for s in first.train)
        book.consumed(again, trainer_version=1)
        book.flush()  # the marks and acks run on the book's call thread
        book.checkpointed(trainer_version=1)
        book.flush()  # the marks and acks run on the book's call thread
        assert (book.acked, len(book.ledger), book.skipped) == (BATCH, 0, BATCH)
    finally:
        book.close()
        client.close()
    after = stats(buffer.address)
    assert (after.acked, after.pending, after.leased, after.redelivered) == (BATCH, 0, 0, BATCH)


def test_ctrl_c_does_not_wait_for_acks_retrying_against_a_stopped_buffer(tmp_path, service_factory):
    """Ctrl-C stops every process of a run at once: the trainer's last acks then retried against the stopped buffer
    (UNAVAILABLE, up to retry_deadline_s) while its exit waited for them, past the run's 15 s (test_quickstart_experiment's
    Ctrl-C test). train() closes the book without waiting on KeyboardInterrupt; the lease is simply redelivered."""
    from trainer.buffer_client import BufferClient
    from trainer.config.buffer import BufferClientConfig
    from trainer.leases import LeaseBook

    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    put(buffer.address, make_samples(BATCH))
    client = BufferClient(BufferClientConfig(address=buffer.address, max_wait_s=10, retry_deadline_s=60))
    book = LeaseBook(client, interval_s=60, ack_on_checkpoint=False)
    try:
        work = book.work(book.pull(BATCH))
        buffer.stop(timeout=10)
        book.consumed(work, trainer_version=1)  # its ack now retries on the book's call thread
        time.sleep(0.5)
        started = time.monotonic()
        book.close(wait=False)
        assert time.monotonic() - started < 1.0
    finally:
        client.close()


def test_batches_trained_when_the_buffer_restarts_come_back_and_are_acked_without_training(
    tmp_path, service_factory, free_port
):
    """The buffer (max_staleness 1) is SIGKILLed while the trainer holds one consumed batch and trains another;
    restarted, it is told a version far ahead. Both batches come back (before, they were dropped as stale and
    stayed in the ledger for good), the ledger moves them to their new leases, and they are acked untrained."""
    from trainer.buffer_client import BufferClient
    from trainer.config.buffer import BufferClientConfig
    from trainer.leases import LeaseBook

    address = f"127.0.0.1:{free_port}"
    settings = {"data_dir": str(tmp_path / "buffer"), "server.address": address, "max_staleness": 1}
    buffer = service_factory("buffer", settings)
    put(address, make_samples(3 * BATCH))  # weight version 0
    client = BufferClient(BufferClientConfig(address=address, max_wait_s=5, pull_timeout_s=2))
    book = LeaseBook(client, interval_s=60, ack_on_checkpoint=True)
    try:
        consumed = book.work(book.pull(BATCH))
        book.consumed(consumed, trainer_version=1)
        book.flush()  # the marks and acks run on the book's call thread
        in_training = book.work(book.pull(BATCH))
        buffer.kill()
        service_factory("buffer", settings)  # same address and data: the leases are gone
        book.consumed(in_training, trainer_version=2)  # the step ends after the restart
        book.flush()  # the marks and acks run on the book's call thread
        client.set_version(100)
        book.checkpointed(trainer_version=100)
        book.flush()  # the marks and acks run on the book's call thread
        assert (book.redelivered, book.acked, len(book.ledger)) == (2, 0, 2 * BATCH)
        trained = {s.sample_id for work in (consumed, in_training) for s in work.train}
        back = [book.work(book.pull(BATCH)) for _ in range(2)]
        assert all(work.train == [] for work in back)
        assert {i for work in back for i in work.already_trained} == trained
        for work in back:
            book.consumed(work, trainer_version=100)
            book.flush()  # the marks and acks run on the book's call thread
        assert sorted(book.ledger.leases()) == sorted(work.lease_id for work in back)
        book.checkpointed(trainer_version=100)
        book.flush()  # the marks and acks run on the book's call thread
        assert (book.acked, len(book.ledger), book.skipped) == (2 * BATCH, 0, 2 * BATCH)
    finally:
        book.close()
        client.close()
    after = stats(address)
    assert (after.acked, after.pending, after.leased, dict(after.dropped)) == (2 * BATCH, 0, 0, {"stale": BATCH})


def test_the_ledger_moves_a_redelivered_sample_to_its_new_lease():
    from trainer.leases import Ledger

    ledger = Ledger({"l1": ["a", "b"]})
    ledger.record("l2", ["b", "c"])
    assert ledger.entries() == {"l1": ["a"], "l2": ["b", "c"]} and "b" in ledger
    ledger.settle("l2")
    assert ledger.entries() == {"l1": ["a"]} and "b" not in ledger and len(ledger) == 1
    ledger.record("l3", ["a"])
    assert ledger.leases() == ["l3"]


@pytest.mark.slow
def test_a_trainer_killed_between_checkpoints_trains_every_acked_sample_exactly_once(
    tiny_model_dir, tmp_path, service_factory
):
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "lease_timeout_s": 2.0})
    samples = make_samples(24 * BATCH)
    put(buffer.address, samples)
    max_steps, interval = 12, 4
    overrides = trainer_overrides(tiny_model_dir, buffer.address, tmp_path, max_steps,
                                  **{"checkpoint.interval": str(interval), "buffer.lease_timeout_s": "2"})
    first_metrics, second_metrics = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first = start_trainer([*overrides, "--set", f"metrics_path={first_metrics}"], tmp_path / "first.log")
    deadline = time.monotonic() + 180
    # Two steps past the checkpoint at step 4: before, both were acked already and lost with the crash. The
    # checkpoint is written off the training thread: wait for it too (a DCP save of the tiny model takes ~0.15 s,
    # longer than two of its steps on a busy machine).
    latest = tmp_path / "checkpoints" / "latest"
    while len(records(first_metrics)) < interval + 2 or not latest.exists():
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the first trainer did not reach step 6 within 180 s"
        time.sleep(0.01)
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    assert latest.read_text() == f"step_{interval:08d}"

    second = start_trainer([*overrides, "--set", f"metrics_path={second_metrics}"], tmp_path / "second.log")
    assert second.wait(240) == 0, (tmp_path / "second.log").read_text()[-3000:]
    assert records(second_metrics)[0]["step"] == interval + 1
    history = lineage([records(first_metrics), records(second_metrics)])
    assert len(history) == max_steps
    assert_exactly_once(history, {s.sample_id for s in samples}, buffer.address, everything_acked=True)


@pytest.mark.slow
def test_the_trainer_survives_a_buffer_restart_and_trains_every_acked_sample_once(
    tiny_model_dir, tmp_path, service_factory, free_port
):
    address = f"127.0.0.1:{free_port}"
    settings = {"data_dir": str(tmp_path / "buffer"), "server.address": address, "lease_timeout_s": 3.0}
    buffer = service_factory("buffer", settings)
    samples = make_samples(24 * BATCH)
    put(address, samples)
    max_steps = 14
    metrics = tmp_path / "metrics.jsonl"
    overrides = trainer_overrides(tiny_model_dir, address, tmp_path, max_steps,
                                  **{"checkpoint.interval": "3", "buffer.lease_timeout_s": "3", "metrics_path": str(metrics)})
    trainer = start_trainer(overrides, tmp_path / "trainer.log")
    deadline = time.monotonic() + 180
    while len(records(metrics)) < 4:
        assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the trainer did not reach step 4 within 180 s"
        time.sleep(0.01)
    buffer.kill()
    time.sleep(1.0)
    service_factory("buffer", settings)  # same address, same data: leases are gone, samples are not
    assert trainer.wait(240) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    history = records(metrics)
    assert len(history) == max_steps
    assert_exactly_once(history, {s.sample_id for s in samples}, address, everything_acked=False)


def test_buffer_calls_of_a_step_run_in_order_off_the_training_thread():
    """consumed() returns before its (slow) ExtendLease lands; the mark, a checkpoint's write submitted after it
    and the checkpoint's acks run in that order; a failed call is raised on the training thread."""
    from trainer.buffer_client import LeasedBatch
    from trainer.leases import LeaseBook

    events = []

    class SlowBuffer:
        def pull(self, batch_size, trainer_version=None):
            return LeasedBatch(f"lease-{len(events)}", make_samples(BATCH), 0)

        def extend(self, lease_ids, consumed=False, trainer_version=None):
            time.sleep(0.3)
            if consumed and trainer_version == 99:
                raise ConnectionError("buffer gone")
            events.append(("consumed", tuple(lease_ids), trainer_version))
            return []

        def ack(self, lease_id, trainer_version=None):
            events.append(("ack", lease_id))
            return BATCH

    book = LeaseBook(SlowBuffer(), interval_s=60, ack_on_checkpoint=True)
    try:
        work = book.work(book.pull(BATCH))
        started = time.monotonic()
        book.consumed(work, trainer_version=1)
        returned_after_s = time.monotonic() - started
        book.calls.submit(lambda: events.append(("checkpoint written",)))
        book.checkpointed(trainer_version=1)
        book.flush()
        assert returned_after_s < 0.2, f"consumed() waited {returned_after_s:.2f} s for the buffer"
        assert events == [("consumed", (work.lease_id,), 1), ("checkpoint written",), ("ack", work.lease_id)]
        assert book.acked == BATCH and len(book.ledger) == 0

        book.consumed(book.work(book.pull(BATCH)), trainer_version=99)
        with pytest.raises(RuntimeError, match="lease call to the buffer failed"):
            book.flush()
    finally:
        book.calls.close()
        book.keeper.close()
