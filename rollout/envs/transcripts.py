"""SFT warm-up data: episodes played in code by a scripted player, tokenized exactly as sessions do.

A tiny model cannot use a tool from nothing. These transcripts show it the protocol: each is one
episode of an environment, its prompt rendered by `render_prompt`, each player turn as the text's
tokens plus eos (as generation ends a turn), each observation by `render_continuation` after a closed
turn, so SFT trains on the very token sequences the runner's sessions will hold. Loss mask 1 on the
player's tokens only.

`skill` is the chance each turn is the expert's; otherwise the player makes a plausible mistake (a
wrong digit in the tool call; a guess anywhere the feedback left open instead of the middle), so the
warm-up leaves RL room to improve.
"""

import random
from collections.abc import Callable, Sequence

import numpy as np

from protos.sample import Sample
from rollout.envs.base import Environment, Message, Task, environment_class
from rollout.envs.tool_use import TOOL, tool_call_text
from rollout.serve.chat import render_continuation, render_prompt

Player = Callable[[Environment, list[Message], random.Random, float], str]


def tool_use_player(env: Environment, history: list[Message], rng: random.Random, skill: float) -> str:
    """Call the calculator on the task's expression, then answer with what it returned."""
    if history[-1]["role"] == "tool":
        return history[-1]["content"]
    expr = env.task.task_id
    if rng.random() >= skill:
        i = rng.choice([i for i, c in enumerate(expr) if c.isdigit()])
        expr = expr[:i] + str((int(expr[i]) + rng.randint(1, 9)) % 10) + expr[i + 1:]
    return tool_call_text(TOOL, {"expr": expr})


def guess_number_player(env: Environment, history: list[Message], rng: random.Random, skill: float) -> str:
    """Guess in the range the feedback leaves open: its middle (bisection), or anywhere in it."""
    low, high = 1, env.config.max_number
    for guess, feedback in zip(history[1::2], history[2::2]):
        if feedback["content"] == "higher":
            low = max(low, int(guess["content"]) + 1)
        elif feedback["content"] == "lower":
            high = min(high, int(guess["content"]) - 1)
    return str((low + high) // 2 if rng.random() < skill else rng.randint(low, high))


PLAYERS: dict[str, Player] = {"tool_use": tool_use_player, "guess_number": guess_number_player}


def play_transcript(tokenizer, env: Environment, player: Player, rng: random.Random, skill: float,
                    sample_id: str) -> Sample:
    """One episode by `player`, as the sample a session of it would close into."""
    history = env.reset()
    prompt = render_prompt(tokenizer, history)
    response: list[int] = []
    mask: list[int] = []
    reward, done = 0.0, False
    while not done:
        action = player(env, history, rng, skill)
        turn = [*tokenizer.encode(action, add_special_tokens=False), tokenizer.eos_token_id]
        response += turn
        mask += [1] * len(turn)
        observation, step_reward, done = env.step(action)
        reward += step_reward
        history = [*history, {"role": "assistant", "content": action}, *observation]
        if not done:
            added = render_continuation(tokenizer, observation, turn_closed=True)
            response += added
            mask += [0] * len(added)
    n = len(response)
    return Sample(
        sample_id=sample_id, prompt_id=env.task.task_id, group_id=sample_id,  # independent episodes, not a group
        prompt_ids=np.asarray(prompt, np.int32), response_ids=np.asarray(response, np.int32),
        loss_mask=np.asarray(mask, np.uint8), rollout_logprobs=np.zeros(n, np.float32),
        weight_versions=np.zeros(n, np.int64), reward=reward, metadata={"solved": env.solved, "turns": env.turns},
    )


def transcripts(tokenizer, env_name: str, env_config: dict, tasks: Sequence[Task], count: int, skill: float,
                seed: int) -> list[Sample]:
    """`count` transcripts of `env_name` over `tasks` (cycled in a seeded order), without tool latency."""
    cls = environment_class(env_name)
    config = cls.Config.model_validate(env_config)
    if "latency_s" in type(config).model_fields:
        config = config.model_copy(update={"latency_s": (0.0, 0.0)})
    rng = random.Random(seed)
    order = [tasks[i % len(tasks)] for i in range(count)]
    rng.shuffle(order)
    return [play_transcript(tokenizer, cls(task, config, random.Random(rng.random())), PLAYERS[env_name], rng,
                            skill, f"sft/{env_name}/{i}") for i, task in enumerate(order)]
