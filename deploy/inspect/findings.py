"""What `relayrl doctor` reports: findings (ok, warn, error; each with its fix, and for a run's diagnosis the
evidence from its files), printed with their counts and the exit code they come to."""

import json
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


def report(findings: list[Finding]) -> int:
    """Print each finding and the counts; 1 when any is an error (the doctor's exit code), else 0."""
    for finding in findings:
        print(finding.render())
    errors = sum(f.level == "error" for f in findings)
    warnings = sum(f.level == "warn" for f in findings)
    print(json.dumps({"errors": errors, "warnings": warnings}))
    return 1 if errors else 0
