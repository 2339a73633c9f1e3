"""The episode runner: plays environments against the rollout service's sessions, groups of episodes at a time.

    for each task: group_size episodes, concurrently, each one session:
        OpenSession(the env's first messages) -> GenerateInSession -> env.step -> AppendToSession(observation)
        -> ... -> CloseSession(reward, submit: the rollout puts the episode into the buffer under the group)

The episodes of one task form one GRPO group. A group starts only when admission control lets it
(rollout/driver/admission.py, the rule the driver applies): it must train within max_staleness of the policy
that generates it. Group and sample ids carry a producer id (fresh at each start), so a restarted runner
never reuses an id the buffer holds.

Retry, never silently skip: an episode that fails for an infrastructure reason (its replica lost: UNAVAILABLE; its
session lost with its KV: NOT_FOUND; a deadline: DEADLINE_EXCEEDED; refused for now: RESOURCE_EXHAUSTED) or whose
environment raises is played again from the start with a fresh environment instance on a fresh session, under the
same sample id (the buffer drops a second copy of one it stored), up to `episode_retries` times; the failed attempt's
session is closed unsubmitted, so it never trains. A group whose episode runs out of retries is dropped alone (its
members already stored are dropped by the buffer as an incomplete group); the run goes on. `stats` counts retries
and dropped groups by cause. A context that fills up (OUT_OF_RANGE) ends the episode where it is.
"""

import asyncio
import logging
import random
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from pydantic import Field

from protos import buffer_pb2, buffer_pb2_grpc, common_pb2, rollout_pb2, rollout_pb2_grpc
from protos.codec import pack_metadata
from protos.sample import Sample
from rollout.driver.producer import RETRYABLE, GroupProducer, run_producer
from rollout.driver.trajectory_log import TrajectoryLogConfig
from rollout.envs.base import Environment, Message, Task, environment_class
from rollout.serve.tool_calls import split_tool_calls
from services.client import connect
from services.config import Strict

log = logging.getLogger("relayrl.runner")

_REPLAY = (*RETRYABLE, grpc.StatusCode.NOT_FOUND)  # the session is gone or was never opened: play again
_CAUSES = {grpc.StatusCode.UNAVAILABLE: "replica_lost", grpc.StatusCode.NOT_FOUND: "session_lost",
           grpc.StatusCode.DEADLINE_EXCEEDED: "deadline", grpc.StatusCode.RESOURCE_EXHAUSTED: "refused"}
ENV_ERROR = "env_error"  # the environment raised


class EnvironmentFailed(Exception):
    """The environment's reset or step raised (the cause is chained)."""


class EpisodeFailed(Exception):
    """An episode failed on every attempt; `cause` is the last one's (_CAUSES' values or ENV_ERROR)."""

    def __init__(self, sample_id: str, cause: str, detail: str):
        super().__init__(f"episode {sample_id}: {cause}: {detail}")
        self.cause = cause


class RunnerConfig(Strict):
    """Where the services are, which environment, how to sample."""

    rollout: str = Field(description="Rollout service address host:port (its `buffer` set, for CloseSession submit).")
    buffer: str = Field(description="Replay buffer address (admission control reads its Stats).")
    env: str = Field(description="Environment name (rollout/envs/base.py ENVIRONMENTS).")
    env_config: dict = Field(default_factory=dict, description="The environment's Config fields.")
    group_size: int = Field(8, ge=1, description="Episodes per task (the GRPO group).")
    groups_per_batch: int = Field(8, ge=1, description="Groups in one training batch.")
    max_staleness: int = Field(1, ge=0, description="Versions a sample may lag the trainer; 0 = on-policy.")
    versions_per_batch: int = Field(
        1, ge=1, description="Weight versions the trainer advances per batch it takes (its batch.mini_batches).")
    admission_poll_s: float = Field(
        0.025, gt=0, description="Poll buffer Stats and the rollout's GetWeightVersion at most this often.")
    producer_id: str | None = Field(
        None, description="Goes into every group and sample id; None = a fresh random token at each start.")
    position_path: str | None = Field(
        None, description="Keep the runner's place in the task stream here (rollout/driver/position.py): a runner started "
        "again goes on from it.")
    temperature: float = Field(1.0, ge=0, description="The same in every turn (a session's logprobs have one).")
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(96, gt=0, description="Longest policy turn.")
    concurrency: int = Field(8, ge=1, description="Groups in flight at once (each plays group_size episodes).")
    max_groups: int = Field(0, ge=0, description="Stop after this many groups (0 = run until stopped).")
    episode_retries: int = Field(
        30, ge=0, description="Times one episode is played again, with a fresh environment, after it failed for an "
        "infrastructure reason (its replica or session lost, a deadline, refused) or its environment raised.")
    seed: int = 0
    stats_path: str | None = Field(None, description="Append a JSON line of runner stats here every 2 s.")
    rpc_timeout_s: float = Field(120.0, gt=0, description="Deadline of each rollout/buffer call.")
    trajectory_log: TrajectoryLogConfig = Field(
        default_factory=TrajectoryLogConfig, description="A sample of the groups of episodes, turn by turn, kept for "
        "`relayrl view` (rollout/driver/trajectory_log.py); off without a path.")


@dataclass
class Episode:
    """What one played episode came to."""

    reward: float
    solved: bool
    turns: int
    tokens: int  # policy tokens generated
    truncated: bool  # the context filled up before the environment was done
    submitted: bool  # the rollout put it into the buffer
    sample: common_pb2.Sample  # the episode as the session closed it
    opening: list[Message] = field(default_factory=list)  # the environment's first messages
    # turn by turn: {"role": "assistant", "text"} for the policy's, then the environment's messages and reward
    transcript: list[dict] = field(default_factory=list)


def env_spec(name: str, env_config: dict) -> tuple[type[Environment], Strict]:
    """The environment class registered as `name` and its validated config."""
    cls = environment_class(name)
    return cls, cls.Config.model_validate(env_config)


def _messages(observation: Sequence[Message]) -> list[rollout_pb2.ChatMessage]:
    return [rollout_pb2.ChatMessage(**message) for message in observation]


async def play_episode(stub: rollout_pb2_grpc.RolloutStub, env: Environment, session_id: str,
                       params: rollout_pb2.SamplingParams, close: rollout_pb2.CloseSessionRequest,
                       timeout_s: float) -> Episode:
    """One episode on one session, closed with `close`'s fields (its reward filled in here).

    Raises grpc.aio.AioRpcError for what the caller must decide (a lost session, a bad request)."""
    opening = _env_call(env.reset)
    await stub.OpenSession(rollout_pb2.OpenSessionRequest(session_id=session_id, messages=_messages(opening)),
                           timeout=timeout_s)
    reward, tokens, done, truncated = 0.0, 0, False, False
    transcript: list[dict] = []
    while not done:
        params.seed = (params.seed * 1_000_003 + 1) % 2**63  # a fresh seed each turn, reproducible
        text = []
        try:
            async for chunk in stub.GenerateInSession(
                    rollout_pb2.GenerateInSessionRequest(session_id=session_id, params=params, whole_turn=True),
                    timeout=timeout_s):
                text.append(chunk.text)
                tokens += chunk.token_ids.length
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.OUT_OF_RANGE:
                raise
            truncated = True
            break
        transcript.append({"role": "assistant", "text": "".join(text)})
        try:
            observation, step_reward, done = await env.astep(transcript[-1]["text"])
        except Exception as exc:  # the environment's own code: whatever it raises, the episode is played again
            raise EnvironmentFailed(f"{type(env).__name__}.step raised {exc!r}") from exc
        transcript.append({"role": "environment", "messages": list(observation), "reward": step_reward, "done": done})
        reward += step_reward
        if not done:
            try:
                await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
                    session_id=session_id, messages=_messages(observation), turn_reward=step_reward),
                    timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.OUT_OF_RANGE:
                    raise
                truncated = True
                break
    close.session_id, close.reward = session_id, reward
    close.metadata = pack_metadata({"solved": env.solved, "turns": env.turns, "truncated": truncated})
    reply = await stub.CloseSession(close, timeout=timeout_s)
    return Episode(reward, env.solved, env.turns, tokens, truncated, reply.submitted, reply.sample, opening,
                   transcript)


def _env_call(call):
    try:
        return call()
    except Exception as exc:  # the environment's own code (see play_episode)
        raise EnvironmentFailed(f"{call.__qualname__} raised {exc!r}") from exc


class Runner(GroupProducer):
    def __init__(self, config: RunnerConfig):
        super().__init__(config, [connect(config.rollout), connect(config.buffer)])
        self.env_cls, self.env_config = env_spec(config.env, config.env_config)
        self.rollout = rollout_pb2_grpc.RolloutStub(self.channels[0])
        self.buffer = buffer_pb2_grpc.BufferStub(self.channels[1])
        self.stats = {"groups": 0, "episodes": 0, "solved": 0, "reward_sum": 0.0, "turns_sum": 0, "tokens": 0,
                      "truncated": 0, "submitted": 0, "put_here": 0, "replays": 0, "retries": 0,
                      "replays_by_cause": {}, "dropped_groups": 0, "drops_by_cause": {}}

    async def run_episode(self, task: Task, group_id: str, index: int, group_index: int) -> Episode:
        """One episode of the group, played again from the start with a fresh environment while it fails (see the
        module docstring); EpisodeFailed once it has failed 1 + episode_retries times."""
        cfg = self.config
        sample_id = f"{group_id}/{index}"
        attempt = 0
        while True:
            env = self.env_cls(task, self.env_config, random.Random(f"{cfg.seed}/{sample_id}/{attempt}"))
            params = rollout_pb2.SamplingParams(
                temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens, n=1, logprobs=True,
                seed=(cfg.seed * 1_000_003 + group_index * 1009 + index) % 2**63)
            close = rollout_pb2.CloseSessionRequest(
                submit=True, group_id=group_id, group_size=cfg.group_size, prompt_id=task.task_id,
                sample_id=sample_id)
            session_id = f"{sample_id}~{attempt}"
            try:
                episode = await play_episode(self.rollout, env, session_id, params, close, cfg.rpc_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _REPLAY:
                    raise
                cause, detail = _CAUSES[exc.code()], f"{exc.code().name} ({exc.details()})"
            except EnvironmentFailed as exc:
                cause, detail = ENV_ERROR, str(exc)
            else:
                if not episode.submitted:  # the rollout gave up on the buffer: put the episode there from here
                    log.warning("episode %s: the rollout did not store it; putting it into the buffer", sample_id)
                    await self._call(self.buffer.Put, buffer_pb2.PutRequest(samples=[episode.sample]))
                    self.stats["put_here"] += 1
                return episode
            await self._discard(session_id)  # the failed attempt is never submitted: it does not train
            if attempt >= cfg.episode_retries:
                raise EpisodeFailed(sample_id, cause, detail)
            self.stats["replays"] += 1
            _count(self.stats["replays_by_cause"], cause)
            log.info("episode %s: %s: %s; playing it again with a fresh environment", session_id, cause, detail)
            await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
            attempt += 1

    async def _discard(self, session_id: str) -> None:
        """Close a session given up on, if the rollout still holds it (else it expires by itself)."""
        try:
            await self.rollout.CloseSession(rollout_pb2.CloseSessionRequest(session_id=session_id), timeout=5.0)
        except grpc.aio.AioRpcError:
            pass

    async def run_group(self, task: Task, group_index: int) -> None:
        cfg = self.config
        group_id = f"{task.task_id}#{self.producer_id}.{group_index}"
        results = await asyncio.gather(*(self.run_episode(task, group_id, i, group_index)
                                         for i in range(cfg.group_size)), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, EpisodeFailed):
                raise result
        failed = [result for result in results if isinstance(result, EpisodeFailed)]
        if failed:  # dropped alone: the run goes on
            self.stats["dropped_groups"] += 1
            _count(self.stats["drops_by_cause"], failed[0].cause)
            log.warning("group %s dropped: %s", group_id, failed[0])
            return
        episodes = results
        self.log_group("episodes", group_index, lambda: [Sample.from_proto(e.sample) for e in episodes],
                       prompt={"messages": episodes[0].opening, "metadata": {}},
                       extra=lambda: [episode_turns(e) for e in episodes])
        s = self.stats
        s["groups"] += 1
        for episode in episodes:
            s["episodes"] += 1
            s["solved"] += episode.solved
            s["reward_sum"] += episode.reward
            s["turns_sum"] += episode.turns
            s["tokens"] += episode.tokens
            s["truncated"] += episode.truncated
            s["submitted"] += episode.submitted

    def snapshot(self) -> dict:
        elapsed = time.monotonic() - self.started_at
        s = self.stats
        episodes = s["episodes"] or 1
        return {
            "time": time.time(), "elapsed_s": elapsed, "producer_id": self.producer_id, "version": self.version,
            **s, "admission_polls": self.gauge.polls, "version_wakeups": self.gauge.wakeups,
            "success_rate": s["solved"] / episodes, "mean_reward": s["reward_sum"] / episodes,
            "mean_turns": s["turns_sum"] / episodes,
            # the driver's names, which deploy/record/progress.py shows
            "samples": s["episodes"], "completions_per_s": s["episodes"] / elapsed if elapsed else 0.0,
            "tokens_per_s": s["tokens"] / elapsed if elapsed else 0.0, "trajectory_log": self.trajectories.stats,
        }

def _count(counts: dict[str, int], cause: str) -> None:
    counts[cause] = counts.get(cause, 0) + 1


def episode_turns(episode: Episode) -> dict:
    """An episode's turns for the trajectory log: each policy turn's text and tool calls, each answer of the
    environment; and how the episode ended."""
    turns = []
    for turn in episode.transcript:
        if turn["role"] == "assistant":
            content, calls = split_tool_calls(turn["text"])
            turn = {**turn, "content": content, "tool_calls": [{"name": c.name, "arguments": c.arguments}
                                                                for c in calls]}
        turns.append(turn)
    return {"turns": turns, "metadata": {"solved": episode.solved, "turns": episode.turns,
                                         "truncated": episode.truncated}}


async def evaluate(address: str, env_name: str, env_config: dict, tasks: Sequence[Task], max_tokens: int,
                   concurrency: int = 32, retry_for_s: float = 300.0) -> dict:
    """Greedy episodes of `tasks` through sessions (the weights served right now), nothing submitted.

    Returns success_rate, mean_reward, mean_turns. An episode whose session is lost (a restarting
    rollout) is played again for up to `retry_for_s`."""
    cls, config = env_spec(env_name, env_config)
    semaphore = asyncio.Semaphore(concurrency)
    run_id = secrets.token_hex(4)
    async with connect(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)

        async def one(i: int, task: Task) -> Episode:
            give_up = time.monotonic() + retry_for_s
            attempt = 0
            async with semaphore:
                while True:
                    params = rollout_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, n=1)
                    try:
                        return await play_episode(stub, cls(task, config, random.Random(i)),
                                                  f"eval-{run_id}/{i}~{attempt}", params,
                                                  rollout_pb2.CloseSessionRequest(), 60.0)
                    except grpc.aio.AioRpcError as exc:
                        if exc.code() not in _REPLAY or time.monotonic() > give_up:
                            raise
                        attempt += 1
                        await asyncio.sleep(0.5)

        episodes = await asyncio.gather(*(one(i, task) for i, task in enumerate(tasks)))
    n = len(episodes)
    return {"success_rate": sum(e.solved for e in episodes) / n, "mean_reward": sum(e.reward for e in episodes) / n,
            "mean_turns": sum(e.turns for e in episodes) / n}


async def run_runner(config: RunnerConfig) -> dict:
    cls, env_config = env_spec(config.env, config.env_config)
    train_tasks, _ = cls.tasks(env_config, config.seed)
    return await Runner(config).run_to_end(train_tasks)


def main(argv: list[str] | None = None) -> int:
    return run_producer("runner", "Play environment episodes against the rollout service's sessions.", RunnerConfig,
                        run_runner, argv)


if __name__ == "__main__":
    sys.exit(main())
