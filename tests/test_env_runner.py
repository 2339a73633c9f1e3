"""The episode runner against real services (a buffer, and a rollout that submits closed sessions to it):
episodes reach the buffer as whole GRPO groups, token-exact, with loss mask 1 exactly on the policy's turns
and the environment's observations rendered by the chat template in between; admission control holds
groups back until the trainer consumes what is there."""

import asyncio
import json
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from protos import buffer_pb2, buffer_pb2_grpc
from protos.codec import decode_array, unpack_metadata
from rollout.envs.base import environment_class
from rollout.envs.runner import Runner, RunnerConfig
from rollout.model.tiny import char_tokenizer
from rollout.serve.chat import render_continuation
from services.client import connect_sync

ENV = {"max_number": 15, "max_turns": 3}


@pytest.fixture
def services(service_factory, tiny_model_dir, tmp_path):
    """(buffer, rollout) processes; the rollout submits closed sessions to the buffer."""
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    rollout = service_factory("rollout", {"model": str(tiny_model_dir), "engine.torch_threads": 1,
                                          "buffer": buffer.address})
    return buffer, rollout


def pull(address: str, batch_size: int, ack: bool = False) -> list:
    with connect_sync(address) as channel:
        stub = buffer_pb2_grpc.BufferStub(channel)
        [batch] = list(stub.Pull(buffer_pb2.PullRequest(batch_size=batch_size, max_batches=1, consumer="test"),
                                 timeout=30))
        if ack:
            stub.Ack(buffer_pb2.AckRequest(lease_id=batch.lease_id), timeout=10)
    return list(batch.samples)


def policy_turns(response: list[int], mask: list[int]) -> list[list[int]]:
    """The runs of loss mask 1: one per policy turn (an observation, mask 0, lies between two)."""
    turns, previous = [], 0
    for token, trained in zip(response, mask):
        if trained and not previous:
            turns.append([])
        if trained:
            turns[-1].append(token)
        previous = trained
    return turns


def test_runner_process_submits_whole_groups_token_exact(services, tmp_path, tiny_model_dir):
    buffer, rollout = services
    config = tmp_path / "runner.yaml"
    config.write_text(yaml.safe_dump({
        "rollout": rollout.address, "buffer": buffer.address, "env": "guess_number", "env_config": ENV,
        "group_size": 3, "groups_per_batch": 2, "max_staleness": 2, "max_tokens": 6, "max_groups": 2,
        "producer_id": "p0", "seed": 1, "stats_path": str(tmp_path / "stats.jsonl"),
        "trajectory_log": {"path": str(tmp_path / "trajectories.jsonl"), "every_n_groups": 1,
                           "tokenizer": str(tiny_model_dir)}}))
    done = subprocess.run([sys.executable, "-m", "rollout.envs.runner", "--config", str(config)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    logged = [json.loads(line) for line in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    stats = json.loads((tmp_path / "stats.jsonl").read_text().splitlines()[-1])
    assert stats["groups"] == 2 and stats["episodes"] == 6 and stats["submitted"] == 6
    assert stats["turns_sum"] >= 6 and 0 <= stats["success_rate"] <= 1

    samples = pull(buffer.address, 6)
    assert len(samples) == 6
    groups = {s.group_id for s in samples}
    assert len(groups) == 2 and all("#p0." in g and s.group_size == 3 for g in groups for s in samples)
    tokenizer = char_tokenizer()
    cls = environment_class("guess_number")
    env_config = cls.Config(**ENV)
    tasks = {t.task_id: t for t in cls.tasks(env_config, 0)[0]}
    for sample in samples:
        assert sample.sample_id.startswith(sample.group_id + "/")
        prompt = decode_array(sample.prompt_ids, expect="int32").tolist()
        response = decode_array(sample.response_ids, expect="int32").tolist()
        mask = decode_array(sample.loss_mask, expect="uint8").tolist()
        logprobs = decode_array(sample.rollout_logprobs, expect="float32").tolist()
        assert tokenizer.decode(prompt) == "<bos>user\nguess 1-15<eos>\n<bos>assistant\n"
        assert all(lp < 0 for lp, m in zip(logprobs, mask) if m) and all(lp == 0 for lp, m in zip(logprobs, mask) if not m)
        # Replay the episode with the policy's turns: each observation between two turns is the game's answer,
        # rendered as the chat template continues after that turn (closed by eos or not).
        env = cls(tasks[sample.prompt_id], env_config)
        env.reset()
        turns, expected, reward = policy_turns(response, mask), [], 0.0
        for i, turn in enumerate(turns):
            observation, step_reward, done = env.step(tokenizer.decode(turn, skip_special_tokens=True))
            reward += step_reward
            expected += turn
            if not done:
                closed = turn[-1] == tokenizer.eos_token_id
                expected += render_continuation(tokenizer, observation, turn_closed=closed)
            assert done == (i == len(turns) - 1)
        assert response == expected
        assert sample.reward == pytest.approx(reward)
        assert unpack_metadata(sample.metadata)["turns"] == env.turns == len(turns)
    check_trajectory_log(logged, {s.sample_id: s for s in samples}, tokenizer)


def check_trajectory_log(groups: list[dict], samples: dict, tokenizer) -> None:
    """The runner's trajectory log holds both groups, each episode turn by turn as the buffer got it."""
    assert sorted(g["group_index"] for g in groups) == [0, 1] and {g["kind"] for g in groups} == {"episodes"}
    for group in groups:
        assert group["prompt"]["messages"] == [{"role": "user", "content": "guess 1-15"}]
        for record in group["samples"]:
            stored = samples[record["sample_id"]]
            assert record["ids"] == decode_array(stored.response_ids, expect="int32").tolist()
            assert record["loss_mask"] == decode_array(stored.loss_mask, expect="uint8").tolist()
            assert record["tokens"] == [tokenizer.decode([i]) for i in record["ids"]]
            policy = [t for t in record["turns"] if t["role"] == "assistant"]
            answers = [t for t in record["turns"] if t["role"] == "environment"]
            assert len(policy) == len(answers) == record["metadata"]["turns"] and answers[-1]["done"]
            assert all(m["content"] in ("higher", "lower", "1-15") for a in answers[:-1] for m in a["messages"])
            assert record["reward"] == pytest.approx(sum(a["reward"] for a in answers))


def test_admission_holds_groups_until_the_trainer_consumes(services, tmp_path):
    buffer, rollout = services
    config = RunnerConfig(rollout=rollout.address, buffer=buffer.address, env="guess_number", env_config=ENV,
                          group_size=2, groups_per_batch=1, max_staleness=0, max_tokens=4, max_groups=2,
                          admission_poll_s=0.05)

    async def scenario() -> tuple[int, int]:
        runner = Runner(config)
        tasks = environment_class("guess_number").tasks(environment_class("guess_number").Config(**ENV), 0)[0]
        run = asyncio.create_task(runner.run(tasks))
        deadline = time.monotonic() + 60
        while runner.stats["groups"] < 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)
        held = runner.groups_started  # a second group would train one version behind: on-policy says wait
        await asyncio.to_thread(pull, buffer.address, 2, True)  # the trainer takes (and trains) the batch
        await asyncio.wait_for(run, 60)
        await runner.close()
        return held, runner.stats["groups"]

    held, finished = asyncio.run(scenario())
    assert held == 1 and finished == 2


def test_runner_refuses_a_rollout_without_a_buffer(service_factory, tiny_model_dir, tmp_path):
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    rollout = service_factory("rollout", {"model": str(tiny_model_dir), "engine.torch_threads": 1})
    config = RunnerConfig(rollout=rollout.address, buffer=buffer.address, env="guess_number", env_config=ENV,
                          group_size=1, max_tokens=4, max_groups=1)

    async def scenario():
        runner = Runner(config)
        try:
            await runner.run(environment_class("guess_number").tasks(environment_class("guess_number").Config(), 0)[0])
        finally:
            await runner.close()

    with pytest.raises(grpc.aio.AioRpcError) as failure:
        asyncio.run(scenario())
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "buffer" in failure.value.details()


def test_episodes_are_played_again_when_the_rollout_restarts(services, tmp_path):
    buffer, rollout = services
    config = RunnerConfig(rollout=rollout.address, buffer=buffer.address, env="guess_number", env_config=ENV,
                          group_size=2, groups_per_batch=4, max_staleness=4, max_tokens=4, max_groups=4,
                          concurrency=4)

    async def scenario() -> dict:
        runner = Runner(config)
        tasks = environment_class("guess_number").tasks(environment_class("guess_number").Config(**ENV), 0)[0]
        run = asyncio.create_task(runner.run(tasks))
        while runner.groups_started < 4:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(rollout.restart)  # killed with the sessions in flight, then started again
        await asyncio.wait_for(run, 120)
        await runner.close()
        return runner.stats

    stats = asyncio.run(scenario())
    assert stats["groups"] == 4 and stats["episodes"] == 8 and stats["replays"] >= 1
    samples = pull(buffer.address, 8)
    assert sorted(s.sample_id for s in samples) == sorted({s.sample_id for s in samples})
    assert len(samples) == 8 and {len([t for t in samples if t.group_id == s.group_id]) for s in samples} == {2}


class FlakyGuess(environment_class("guess_number")):
    """guess_number whose step raises: on the first instance's first step only (`once`), or on every instance that
    plays the task `doomed`."""

    once = True
    doomed: str | None = None

    def step(self, action: str):
        if FlakyGuess.once or self.task.task_id == FlakyGuess.doomed:
            FlakyGuess.once = False
            raise RuntimeError("the tool's sandbox crashed")
        return super().step(action)


def test_an_environment_that_raises_is_retried_with_a_fresh_instance_and_a_group_out_of_retries_is_dropped(
        services, tmp_path):
    buffer, rollout = services
    tasks = environment_class("guess_number").tasks(environment_class("guess_number").Config(**ENV), 0)[0]

    async def play(groups: int, retries: int) -> dict:
        config = RunnerConfig(rollout=rollout.address, buffer=buffer.address, env="guess_number", env_config=ENV,
                              group_size=2, groups_per_batch=4, max_staleness=4, max_tokens=4, max_groups=groups,
                              concurrency=1, episode_retries=retries)
        runner = Runner(config)
        runner.env_cls = FlakyGuess
        await asyncio.wait_for(runner.run(tasks[:groups]), 120)
        await runner.close()
        return runner.stats

    FlakyGuess.once, FlakyGuess.doomed = True, None
    stats = asyncio.run(play(groups=1, retries=2))
    assert stats["groups"] == 1 and stats["replays_by_cause"] == {"env_error": 1} and stats["dropped_groups"] == 0
    samples = pull(buffer.address, 2, ack=True)
    # The retried episode trains (its session is attempt ~1); the failed attempt's session never reached the buffer.
    sessions = sorted(unpack_metadata(s.metadata)["session_id"].rsplit("~", 1)[1] for s in samples)
    assert len(samples) == 2 and sessions == ["0", "1"]
    assert len({s.sample_id for s in samples}) == 2

    FlakyGuess.once, FlakyGuess.doomed = False, tasks[0].task_id
    stats = asyncio.run(play(groups=2, retries=1))  # the first group's episodes fail twice each: it is dropped alone
    assert stats["dropped_groups"] == 1 and stats["drops_by_cause"] == {"env_error": 1}
    assert stats["groups"] == 1 and stats["replays_by_cause"] == {"env_error": 2}
