"""What `relayrl doctor` reports, of an experiment file (deploy/doctor.py) or of a run folder (deploy/diagnose.py):
one finding per check, with its level and fix."""

from dataclasses import dataclass, field
from typing import Literal

Level = Literal["ok", "warn", "error"]


@dataclass
class Finding:
    level: Level
    check: str
    message: str
    fix: str = ""
    evidence: list[str] = field(default_factory=list)  # "file:line: what it says" (a run's diagnosis)

    def render(self) -> str:
        text = f"{self.level.upper():5} {self.check}: {self.message}"
        text += "".join(f"\n      evidence: {line}" for line in self.evidence)
        return text + (f"\n      fix: {self.fix}" if self.fix else "")
