"""A multi-turn game with feedback: guess the secret number, told "higher" or "lower" after each miss.

    user:      guess 1-15
    assistant: 8
    user:      lower
    assistant: 4
    user:      higher
    assistant: 6                -> solved in 3 turns

Reward: 1 for finding the secret, minus `turn_penalty` for each turn after the first (fewer turns
are better); 0 when `max_turns` run out. Bisection finds any secret of 1-15 within 4 turns; a player
that guesses anywhere in the range the feedback left open often needs more. A turn that is not a
number in range is answered with the range and counts as a turn.
"""


from pydantic import Field

from rollout.envs.base import Environment, Message, Step, Task
from services.config import Strict


class GuessNumberConfig(Strict):
    max_number: int = Field(15, ge=2, le=99, description="The secret is in 1..max_number.")
    max_turns: int = Field(4, ge=1, description="Guesses before the episode ends unsolved.")
    turn_penalty: float = Field(0.1, ge=0, description="Reward lost for each turn after the first.")


class GuessNumber(Environment):
    Config = GuessNumberConfig

    @classmethod
    def tasks(cls, config: GuessNumberConfig, seed: int) -> tuple[list[Task], list[Task]]:
        """Every secret, for training and for evaluation: the policy never sees the secret, so no task can
        leak into another; evaluation plays each secret once."""
        tasks = [Task(f"secret-{n}", {"secret": n}) for n in range(1, config.max_number + 1)]
        return tasks, tasks

    def reset(self) -> list[Message]:
        return [{"role": "user", "content": f"guess 1-{self.config.max_number}"}]

    def step(self, action: str) -> Step:
        self.turns += 1
        text = action.strip()
        guess = int(text) if text.isdigit() else None
        secret = self.task.data["secret"]
        if guess == secret:
            self.solved = True
            return Step([], max(0.0, 1.0 - self.config.turn_penalty * (self.turns - 1)), True)
        if self.turns >= self.config.max_turns:
            return Step([], 0.0, True)
        if guess is None or not 1 <= guess <= self.config.max_number:
            feedback = f"1-{self.config.max_number}"
        else:
            feedback = "higher" if secret > guess else "lower"
        return Step([{"role": "user", "content": feedback}], 0.0, False)
