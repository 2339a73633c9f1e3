"""The example environments and their SFT transcripts, without services: tool calls (well-formed or not),
tool latency, rewards, the game's feedback, and transcripts tokenized exactly as the chat template renders
the whole conversation, loss mask 1 exactly on the player's tokens."""

import asyncio
import json
import random
import time

import pytest

from rollout.envs.base import Task, environment_class
from rollout.envs.guess_number import GuessNumber, GuessNumberConfig
from rollout.envs.tool_use import ToolUse, ToolUseConfig, tool_call_text
from rollout.envs.transcripts import transcripts
from rollout.model.tiny import char_tokenizer

TASK = Task("123*456", {"a": 123, "b": 456, "answer": "56088"})
CALL = tool_call_text("calc", {"expr": "123*456"})


def tool_env(**config) -> ToolUse:
    return ToolUse(TASK, ToolUseConfig(latency_s=(0.0, 0.0), **config), random.Random(0))


def test_tool_use_right_call_then_right_answer_earns_one():
    env = tool_env()
    assert env.reset() == [{"role": "user", "content": "123*456"}]
    observation, reward, done = env.step(CALL)
    assert observation == [{"role": "tool", "name": "calc", "content": "56088"}] and reward == 0 and not done
    assert env.step(" 56088\n") == ([], 1.0, True) and env.solved and env.turns == 2


def test_tool_use_wrong_answer_earns_the_call_credit_only():
    env = tool_env(call_reward=0.2)
    env.step(CALL)
    assert env.step("56089") == ([], 0.2, True) and not env.solved
    assert tool_env(call_reward=0.2).step("56089") == ([], 0.0, True)  # no call made: no credit


@pytest.mark.parametrize("action, error", [
    ('<tool_call>{"name": "calc", "arguments": {"expr": "1*2"</tool_call>', "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "needs"),
    ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "unknown tool 'search'"),
    ('<tool_call>{"name": "calc", "arguments": {"expr": "import os"}}</tool_call>', "calc needs"),
    ('<tool_call>{"name": "calc", "arguments": "123*456"}</tool_call>', "calc needs"),
    ('<tool_call>{"name": "calc", "arguments": {"expr": "123*456"}}', "not closed"),
])
def test_tool_use_malformed_call_gets_an_error_observation_and_the_episode_goes_on(action, error):
    env = tool_env()
    [message], reward, done = env.step(action)
    assert message["role"] == "tool" and message["content"].startswith("error: ") and error in message["content"]
    assert reward == 0 and not done and env.valid_calls == 0
    env.step(CALL)  # the policy may try again
    assert env.step("56088") == ([], 1.0, True)


def test_tool_use_episode_ends_after_max_turns():
    env = tool_env(max_turns=2)
    env.step("<tool_call>oops</tool_call>")
    assert env.step(CALL) == ([], 0.0, True) and env.turns == 2


def test_tool_latency_is_awaited_concurrently():
    config = ToolUseConfig(latency_s=(0.1, 0.15))
    envs = [ToolUse(TASK, config, random.Random(i)) for i in range(20)]

    async def calls():
        return await asyncio.gather(*(env.astep(CALL) for env in envs))

    started = time.monotonic()
    steps = asyncio.run(calls())
    elapsed = time.monotonic() - started
    assert 0.1 <= elapsed < 0.6, elapsed  # 20 calls of >= 0.1 s each, overlapped
    assert all(step.observation[0]["content"] == "56088" for step in steps)
    started = time.monotonic()
    ToolUse(TASK, config).step(CALL)  # the sync step sleeps too
    assert time.monotonic() - started >= 0.1
    started = time.monotonic()
    asyncio.run(ToolUse(TASK, config).astep("<tool_call>{bad</tool_call>"))  # no tool run: no latency
    assert time.monotonic() - started < 0.05


def test_tool_use_config_and_tasks():
    with pytest.raises(ValueError, match="latency_s"):
        ToolUseConfig(latency_s=(0.2, 0.1))
    train, held_out = ToolUse.tasks(ToolUseConfig(num_train=500, num_eval=50), seed=3)
    assert len(train) == 500 and len(held_out) == 50
    assert not {t.task_id for t in train} & {t.task_id for t in held_out}
    assert all(100 <= t.data["a"] <= 999 and t.data["answer"] == str(t.data["a"] * t.data["b"]) for t in train)
    assert ToolUse.tasks(ToolUseConfig(num_train=500, num_eval=50), seed=3) == (train, held_out)
    with pytest.raises(ValueError, match="unknown environment 'chess'"):
        environment_class("chess")


def test_guess_number_feedback_rewards_and_turn_limit():
    env = GuessNumber(Task("secret-6", {"secret": 6}), GuessNumberConfig(max_number=15, max_turns=4))
    assert env.reset() == [{"role": "user", "content": "guess 1-15"}]
    assert env.step("8") == ([{"role": "user", "content": "lower"}], 0.0, False)
    assert env.step("forty") == ([{"role": "user", "content": "1-15"}], 0.0, False)  # not a number: a turn gone
    assert env.step("4") == ([{"role": "user", "content": "higher"}], 0.0, False)
    assert env.step("6") == ([], pytest.approx(0.7), True) and env.solved  # 4 turns: 1 - 3 * 0.1
    env = GuessNumber(Task("secret-6", {"secret": 6}), GuessNumberConfig(max_turns=2))
    env.step("99")
    assert env.step("1") == ([], 0.0, True) and not env.solved
    train, _ = GuessNumber.tasks(GuessNumberConfig(max_number=5), seed=0)
    assert [t.data["secret"] for t in train] == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("env_name", ["tool_use", "guess_number"])
def test_transcripts_are_the_chat_template_rendering_with_the_players_tokens_masked_in(env_name):
    tokenizer = char_tokenizer()
    cls = environment_class(env_name)
    config = cls.Config(num_train=50, num_eval=5, latency_s=(0, 0)) if env_name == "tool_use" else cls.Config()
    train, _ = cls.tasks(config, 0)
    by_id = {task.task_id: task for task in train}
    samples = transcripts(tokenizer, env_name, config.model_dump(), train, 40, skill=1.0, seed=0)
    for sample in samples:
        response, mask = sample.response_ids.tolist(), sample.loss_mask.tolist()
        turns, turn = [], []  # the player's turns: the runs of mask 1, each ending with eos
        for token, trained in zip(response, mask):
            if trained:
                turn.append(token)
            if trained and token == tokenizer.eos_token_id:
                turns.append(turn)
                turn = []
        assert not turn and [t for t, m in zip(response, mask) if m] == [t for turn in turns for t in turn]
        # Replay the episode with those turns: the whole conversation, rendered by the chat template at once,
        # is the transcript (but for the newline the template puts after the last <eos>).
        env = cls(by_id[sample.prompt_id], config)
        messages = env.reset()
        for turn in turns:
            action = tokenizer.decode(turn[:-1])
            messages = [*messages, {"role": "assistant", "content": action}, *env.step(action).observation]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False)
        assert tokenizer.decode([*sample.prompt_ids.tolist(), *response]) + "\n" == rendered
        assert env.solved and sample.reward > 0


def test_transcripts_with_mistakes():
    tokenizer = char_tokenizer()
    train, _ = ToolUse.tasks(ToolUseConfig(num_train=200, num_eval=5), 0)
    samples = transcripts(tokenizer, "tool_use", {}, train, 200, skill=0.5, seed=1)
    solved = sum(s.metadata["solved"] for s in samples)
    assert 60 < solved < 140  # about half call with a wrong digit, and answer what the tool said
    calls = [json.loads(tokenizer.decode(s.response_ids.tolist()).split("<tool_call>")[1].split("</tool_call>")[0])
             for s in samples]
    assert all(c["name"] == "calc" and len(c["arguments"]["expr"]) == 7 for c in calls)
    games = transcripts(tokenizer, "guess_number", {}, GuessNumber.tasks(GuessNumberConfig(), 0)[0], 300,
                        skill=0.0, seed=0)
    assert 0.4 < sum(s.metadata["solved"] for s in games) / 300 < 0.8  # guesses anywhere still open


def test_sft_batches_of_transcripts_hold_batch_size_episodes():
    """Transcripts are independent episodes, each its own group: an SFT batch of 32 holds 32 of them. (Grouped by
    task, as the buffer groups the completions of one prompt, a batch of guess-the-number took a whole task's
    ~266 transcripts: SFT ran 8x the samples per step and 8x slower.)"""
    from trainer.dataset import DatasetSource

    tasks = GuessNumber.tasks(GuessNumberConfig(), 0)[0]
    samples = transcripts(char_tokenizer(), "guess_number", {}, tasks, 400, skill=0.0, seed=0)
    assert len({s.group_id for s in samples}) == 400
    assert [len(DatasetSource(samples, seed=0).pull(32).samples) for _ in range(3)] == [32, 32, 32]
