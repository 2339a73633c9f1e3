"""Tool use: multiply two numbers by calling the environment's calculator, then answer.

    user:      123*456
    assistant: <tool_call>{"name": "calc", "arguments": {"expr": "123*456"}}</tool_call>
    tool:      56088            (after 50-200 ms, like a real tool)
    assistant: 56088            -> reward 1 when it is the product

The tool call is the chat template's format (rollout/model/tiny.py renders an assistant's tool_calls this
way), written by the policy as text. No `tools` list is sent: the tiny char-level model's context is
short, and SFT transcripts (rollout/envs/transcripts.py) teach it the protocol. A malformed call (not
JSON, an unknown tool, a bad expression, an unclosed tag) gets an error observation and the episode
goes on; a turn without a tool call is the final answer.
"""

import asyncio
import json
import random
import re
import time

from pydantic import Field, model_validator

from rollout.envs.base import Environment, Message, Step, Task
from services.config import Strict

TOOL = "calc"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_EXPR = re.compile(r"^\s*(\d{1,6})\s*([*+-])\s*(\d{1,6})\s*$")
_OPS = {"*": lambda a, b: a * b, "+": lambda a, b: a + b, "-": lambda a, b: a - b}


class ToolUseConfig(Strict):
    digits: int = Field(3, ge=1, le=3, description="Digits of each operand (3: 100..999).")
    num_train: int = Field(20_000, gt=0, description="Training tasks (distinct operand pairs).")
    num_eval: int = Field(100, gt=0, description="Held-out tasks, never trained on.")
    latency_s: tuple[float, float] = Field((0.05, 0.2), description="Each tool run takes uniform(lo, hi) seconds.")
    max_turns: int = Field(3, ge=2, description="Policy turns before the episode ends unanswered.")
    call_reward: float = Field(0.0, ge=0, le=1, description="Reward of an unsolved episode that made a valid "
                               "tool call (partial credit); a right answer earns 1.")

    @model_validator(mode="after")
    def _check(self) -> "ToolUseConfig":
        if not 0 <= self.latency_s[0] <= self.latency_s[1]:
            raise ValueError(f"latency_s: need 0 <= lo <= hi, got {list(self.latency_s)}")
        return self


def tool_call_text(name: str, arguments: dict) -> str:
    """A tool call as the chat template renders one (and as the policy must write it)."""
    return f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {json.dumps(arguments)}}}</tool_call>'


def run_calc(arguments) -> str:
    """The calculator: `a op b` with op one of * + -; ValueError with the message the policy sees."""
    expr = arguments.get("expr") if isinstance(arguments, dict) else None
    match = _EXPR.match(expr) if isinstance(expr, str) else None
    if match is None:
        raise ValueError('calc needs {"expr": "A*B"}')
    a, op, b = match.groups()
    return str(_OPS[op](int(a), int(b)))


class ToolUse(Environment):
    Config = ToolUseConfig

    def __init__(self, task: Task, config: ToolUseConfig, rng: random.Random | None = None):
        super().__init__(task, config, rng)
        self.valid_calls = 0

    @classmethod
    def tasks(cls, config: ToolUseConfig, seed: int) -> tuple[list[Task], list[Task]]:
        low, high = 10 ** (config.digits - 1) if config.digits > 1 else 0, 10**config.digits - 1
        count = config.num_train + config.num_eval
        if count > (high - low + 1) ** 2:
            raise ValueError(f"num_train + num_eval: {count} exceeds the {(high - low + 1) ** 2} operand pairs")
        rng, pairs = random.Random(seed), {}
        while len(pairs) < count:
            pair = (rng.randint(low, high), rng.randint(low, high))
            pairs.setdefault(pair, None)
        tasks = [Task(f"{a}*{b}", {"a": a, "b": b, "answer": str(a * b)}) for a, b in pairs]
        return tasks[config.num_eval:], tasks[:config.num_eval]

    def reset(self) -> list[Message]:
        return [{"role": "user", "content": self.task.task_id}]

    def step(self, action: str) -> Step:
        step, latency = self._respond(action)
        time.sleep(latency)
        return step

    async def astep(self, action: str) -> Step:
        step, latency = self._respond(action)
        await asyncio.sleep(latency)
        return step

    def _respond(self, action: str) -> tuple[Step, float]:
        """The answer to one turn and how long its tool run takes (0 without one)."""
        self.turns += 1
        last = self.turns >= self.config.max_turns
        if "<tool_call>" not in action:
            self.solved = action.strip() == self.task.data["answer"]
            return Step([], self._reward(), True), 0.0
        text, latency = self._call(action)
        if last:
            return Step([], self._reward(), True), latency
        return Step([{"role": "tool", "name": TOOL, "content": text}], 0.0, False), latency

    def _call(self, action: str) -> tuple[str, float]:
        match = _CALL.search(action)
        if match is None:
            return "error: tool call not closed by </tool_call>", 0.0
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError as exc:
            return f"error: tool call is not valid JSON ({exc.msg})", 0.0
        if not isinstance(call, dict) or "name" not in call:
            return 'error: tool call needs {"name": ..., "arguments": {...}}', 0.0
        if call["name"] != TOOL:
            return f"error: unknown tool {str(call['name'])[:20]!r} (tools: {TOOL})", 0.0
        try:
            result = run_calc(call.get("arguments"))
        except ValueError as exc:
            return f"error: {exc}", 0.0
        self.valid_calls += 1
        return result, self.rng.uniform(*self.config.latency_s)

    def _reward(self) -> float:
        if self.solved:
            return 1.0
        return self.config.call_reward if self.valid_calls else 0.0
