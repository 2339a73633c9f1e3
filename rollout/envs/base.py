"""The environment interface: one episode of one task, played turn by turn against a policy.

    observation = env.reset()                    # the first messages, in chat format
    observation, reward, done = env.step(text)   # the policy's turn as text -> the environment's answer

An environment sees only text (the policy's decoded turn) and answers with chat messages, which the
runner appends to the session (rendered by the chat template, loss mask 0). `astep` is the variant
for environments with latency (a tool, a remote service): the runner awaits it, so one slow tool
never holds up the other episodes. Rewards of the steps add up to the episode's reward; `solved`
says whether the episode reached its goal (the success rate).

Each environment is a class registered in ENVIRONMENTS with its config type (`Config`) and its task
list (`tasks(config, seed) -> (train, held_out)`), so a runner, a transcript generator and an
evaluation build it by name.
"""

import importlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from services.config import Strict

Message = dict[str, str]  # {"role": "user" | "tool" | ..., "content": ..., optional "name"}

# name -> "module:Class" of every environment the runner can build.
ENVIRONMENTS = {
    "tool_use": "rollout.envs.tool_use:ToolUse",
    "guess_number": "rollout.envs.guess_number:GuessNumber",
}


@dataclass(frozen=True)
class Task:
    """One task: every episode of a GRPO group plays the same one."""

    task_id: str
    data: dict[str, Any] = field(default_factory=dict)


class Step(NamedTuple):
    observation: list[Message]  # empty when done
    reward: float
    done: bool


class Environment(ABC):
    """One episode. Subclasses set `Config` and implement `tasks`, `reset` and `step`."""

    Config: ClassVar[type[Strict]]

    def __init__(self, task: Task, config: Strict, rng: random.Random | None = None):
        self.task, self.config = task, config
        self.rng = rng or random.Random()
        self.turns = 0  # policy turns stepped so far
        self.solved = False

    @classmethod
    @abstractmethod
    def tasks(cls, config: Strict, seed: int) -> tuple[list[Task], list[Task]]:
        """(train, held-out) tasks, seeded; the two never share a task."""

    @abstractmethod
    def reset(self) -> list[Message]:
        """The episode's first messages (a system or user prompt)."""

    @abstractmethod
    def step(self, action: str) -> Step:
        """The environment's answer to one policy turn."""

    async def astep(self, action: str) -> Step:
        """`step` for the asyncio runner; environments with latency override it to await it."""
        return self.step(action)


def environment_class(name: str) -> type[Environment]:
    """The environment registered as `name` (ValueError naming the known ones otherwise)."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"env: unknown environment {name!r} (known: {', '.join(sorted(ENVIRONMENTS))})")
    module, cls = ENVIRONMENTS[name].split(":")
    return getattr(importlib.import_module(module), cls)
