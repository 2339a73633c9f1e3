"""The trajectory log (rollout/driver/trajectory_log.py): every n-th group as one JSON line, written on its own
thread; a full queue skips a group instead of waiting; past max_bytes it keeps every other group, so it covers the
whole run within its bound."""

import json
import threading

import numpy as np

from protos.sample import Sample, SampleStatus
from rollout.driver.trajectory_log import TrajectoryLog, TrajectoryLogConfig, group_record


def sample(index: int, reward: float, versions=(3, 3, 4)) -> Sample:
    n = len(versions)
    return Sample(sample_id=f"g/{index}", prompt_id="p", group_id="g", group_size=2,
                  prompt_ids=np.array([1, 2], np.int32), response_ids=np.arange(5, 5 + n, dtype=np.int32),
                  loss_mask=np.ones(n, np.uint8), rollout_logprobs=np.full(n, -0.123456, np.float32),
                  weight_versions=np.array(versions, np.int64), reward=reward, reward_details={"match": reward},
                  status=SampleStatus.TRUNCATED if index else SampleStatus.COMPLETED, prompt_text="1+1=",
                  response_text="2", metadata={"answer": "2"})


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_group_record_carries_what_the_viewer_shows():
    record = group_record("group", [sample(0, 1.0), sample(1, 0.0)], "prod", trainer_version=5, served_version=4,
                          spell=lambda ids: [f"<{i}>" for i in ids], time_s=1.0)
    assert record["version"] == 3 and record["prompt"] == {"text": "1+1=", "ids": [1, 2], "metadata": {"answer": "2"}}
    first, second = record["samples"]
    assert first["tokens"] == ["<5>", "<6>", "<7>"] and first["logprobs"] == [-0.1235] * 3
    assert first["versions"] == [3, 3, 4] and first["loss_mask"] == [1, 1, 1] and first["staleness"] == 2
    assert (first["status"], second["status"]) == ("completed", "truncated")
    assert first["reward_details"] == {"match": 1.0} and first["advantage"] is None


def test_every_nth_group_is_written_on_the_writer_thread(tmp_path):
    path = tmp_path / "trajectories.jsonl"
    log = TrajectoryLog(TrajectoryLogConfig(path=str(path), every_n_groups=3))
    threads = set()

    def build(index):
        def make(spell):
            threads.add(threading.current_thread().name)
            return group_record("group", [sample(0, float(index))], "prod", 0, 0, spell, 0.0)
        return make

    for index in range(10):
        log.offer(index, build(index))
    log.close()
    assert [r["group_index"] for r in read(path)] == [0, 3, 6, 9]
    assert threads == {"relayrl-trajectories"} and log.stats["written"] == 4


def test_off_without_a_path_or_with_every_n_0(tmp_path):
    assert not TrajectoryLog(TrajectoryLogConfig()).wants(0)
    assert not TrajectoryLog(TrajectoryLogConfig(path=str(tmp_path / "t.jsonl"), every_n_groups=0)).wants(0)
    assert not (tmp_path / "t.jsonl").exists()


def test_a_full_queue_skips_groups_and_never_waits(tmp_path):
    gate = threading.Event()
    log = TrajectoryLog(TrajectoryLogConfig(path=str(tmp_path / "t.jsonl"), every_n_groups=1, queue_groups=2))

    def slow(spell):
        gate.wait(10)
        return group_record("group", [sample(0, 0.0)], "prod", 0, 0, spell, 0.0)

    for index in range(6):  # the writer holds one, the queue two: three are skipped at once
        log.offer(index, slow)
    assert log.stats["skipped_full"] >= 3
    gate.set()
    log.close()
    assert log.stats["written"] + log.stats["skipped_full"] == 6


def test_past_max_bytes_it_keeps_every_other_group_and_stays_under_the_bound(tmp_path):
    path = tmp_path / "t.jsonl"
    config = TrajectoryLogConfig(path=str(path), every_n_groups=1, max_bytes=8192, queue_groups=256)
    log = TrajectoryLog(config)
    for index in range(200):
        log.offer(index, lambda spell, i=index: group_record("group", [sample(0, float(i))], "prod", 0, 0, spell, 0.0))
    log.close()
    indices = [r["group_index"] for r in read(path)]
    assert path.stat().st_size <= 8192 and log.stats["thinned"] >= 2
    assert indices[0] == 0 and indices[-1] >= 150  # the whole run, early and late, evenly
    assert indices == list(range(0, 200, log.stride))[:len(indices)]

    again = TrajectoryLog(config)  # a restarted producer appends, and the bound still holds
    for index in range(200, 300):
        again.offer(index, lambda spell, i=index: group_record("group", [sample(0, 0.0)], "prod", 0, 0, spell, 0.0))
    again.close()
    assert path.stat().st_size <= 8192 and read(path)[-1]["group_index"] >= 250


def test_a_driver_against_real_services_logs_every_nth_group_spelled(tmp_path, service_factory, tiny_model_dir):
    import asyncio

    from deploy.experiment.tasks import arithmetic_tasks, write_jsonl
    from rollout.driver.driver import Driver, DriverConfig, load_prompts

    rollout = service_factory("rollout", {"model": str(tiny_model_dir), "engine.torch_threads": 1,
                                          "engine.max_model_len": 64})
    reward = service_factory("reward", {})
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "max_staleness": 100})
    path = tmp_path / "trajectories.jsonl"
    config = DriverConfig(rollout=rollout.address, reward=reward.address, buffer=buffer.address,
                          prompts=str(write_jsonl(arithmetic_tasks(digits=1), tmp_path / "prompts.jsonl")),
                          tokenizer=str(tiny_model_dir), group_size=3, groups_per_batch=2, max_staleness=100,
                          max_tokens=4, max_groups=5, trajectory_log={"path": str(path), "every_n_groups": 2})

    async def run() -> Driver:
        driver = Driver(config)
        try:
            await driver.run(load_prompts(config))
        finally:
            await driver.close()
        return driver

    driver = asyncio.run(run())
    groups = read(path)
    assert sorted(g["group_index"] for g in groups) == [0, 2, 4] and driver.stats["groups"] == 5  # in finishing order
    assert driver.snapshot()["trajectory_log"]["written"] == 3
    for group in groups:
        assert group["kind"] == "group" and group["producer_id"] == driver.producer_id
        assert group["prompt"]["text"] and group["prompt"]["metadata"]["answer"] and len(group["samples"]) == 3
        for record in group["samples"]:
            # the char tokenizer spells each token; the text leaves out special tokens (<pad>, <eos>)
            assert "".join(t for t in record["tokens"] if len(t) == 1) == record["text"]
            assert len(record["ids"]) == len(record["logprobs"]) == len(record["versions"]) == len(record["loss_mask"])
            assert all(lp <= 0 for lp in record["logprobs"]) and record["versions"] == [0] * len(record["ids"])
            assert record["reward"] in (0.0, 1.0) and isinstance(record["reward_details"], dict)
            assert record["status"] in ("completed", "truncated") and record["staleness"] == 0


def test_a_group_with_an_image_carries_it_for_the_viewer():
    from protos.sample import SampleImage

    with_image = sample(0, 1.0)
    with_image.images = [SampleImage(b"h" * 32, "image/png", (1, 4, 6), 6, b"\x89PNG-bytes")]
    record = group_record("group", [with_image], "prod", trainer_version=5, served_version=4, spell=None, time_s=0.0)
    assert record["prompt"]["images"] == [{"media_type": "image/png", "data": "iVBORy1ieXRlcw=="}]
    assert "images" not in group_record("group", [sample(1, 0.0)], "prod", 5, 4, None, 0.0)["prompt"]
