"""A run's trajectory log as `relayrl view` reads it: groups by policy version, advantages, filters, text search.

RUN_DIR/trajectories.jsonl (rollout/driver/trajectory_log.py) holds one line per sampled group. The store reads
what was appended since its last look (and all of it again when the log was thinned: a new file), gives each sample
the advantage the run's algorithm computes from its group when the record has none (GRPO: the group-normalised
reward; RLOO: the reward less the mean of the others), and answers the page's questions: which versions, which
groups of a version pass the filters.
"""

import json
import math
import os
import pathlib
from dataclasses import dataclass

import yaml

LOG_FILE = "trajectories.jsonl"


@dataclass
class Filters:
    """Which samples the page shows; a group is shown when one of its samples is."""

    min_reward: float | None = None
    max_reward: float | None = None
    statuses: frozenset[str] | None = None  # None = every status
    min_staleness: int | None = None
    max_staleness: int | None = None
    text: str = ""  # case-insensitive, in the prompt, the completion or an episode's turns

    def admits(self, group: dict, sample: dict) -> bool:
        reward, staleness = sample["reward"], sample.get("staleness")
        if self.min_reward is not None and reward < self.min_reward:
            return False
        if self.max_reward is not None and reward > self.max_reward:
            return False
        if self.statuses is not None and sample["status"] not in self.statuses:
            return False
        if self.min_staleness is not None and (staleness is None or staleness < self.min_staleness):
            return False
        if self.max_staleness is not None and (staleness is None or staleness > self.max_staleness):
            return False
        return not self.text or self.text.lower() in _searchable(group, sample)


def _searchable(group: dict, sample: dict) -> str:
    turns = " ".join(json.dumps(turn, ensure_ascii=False) for turn in sample.get("turns") or [])
    return f"{group['prompt']['text']}\n{sample['text']}\n{turns}".lower()


def estimator(run_dir: pathlib.Path) -> tuple[str | None, dict]:
    """(The advantage estimator of the run's algorithm, its settings) from RUN_DIR/config.yaml: an experiment's
    `algorithm` (a run of the former built-in job: `rl.algorithm`); (None, {}) when the run says nothing the viewer can follow."""
    path = run_dir / "config.yaml"
    config = yaml.safe_load(path.read_text()) if path.is_file() else {}
    algorithm = (config or {}).get("algorithm") or ((config or {}).get("rl") or {}).get("algorithm") or {}
    name = algorithm.get("name", "grpo")
    chosen = algorithm.get("advantage_estimator") or ("grpo" if name == "grpo" else None)
    return (chosen, algorithm) if chosen in ("grpo", "rloo") else (None, algorithm)


def group_advantages(rewards: list[float], kind: str | None, algorithm: dict) -> list[float | None]:
    """Each sample's advantage from its group's rewards, as trainer/advantages.py computes it."""
    n = len(rewards)
    if kind is None or n == 0:
        return [None] * n
    mean = sum(rewards) / n
    if kind == "rloo":
        return [(r - (mean * n - r) / (n - 1)) if n > 1 else 0.0 for r in rewards]
    eps = algorithm.get("grpo_eps", 1e-6)
    if n == 1:
        return [0.0 if algorithm.get("grpo_group_of_one") == "zero" else rewards[0] / (1 + eps)]
    centred = [r - mean for r in rewards]
    if not algorithm.get("grpo_norm_std", True):
        return centred
    std = math.sqrt(sum(c * c for c in centred) / (n - 1))
    return [c / (std + eps) for c in centred]


ESTIMATOR_TEXT = {"grpo": "GRPO: (reward - group mean) / group std", "rloo": "RLOO: reward - mean of the others"}


class TrajectoryStore:
    """The groups of one run's trajectory log, read again as it grows."""

    def __init__(self, run_dir: str | pathlib.Path):
        self.run_dir = pathlib.Path(run_dir)
        self.path = self.run_dir / LOG_FILE
        self.kind, self.algorithm = estimator(self.run_dir)
        self.groups: list[dict] = []
        self._identity: tuple[int, int] | None = None  # (inode, bytes read) of the file read so far

    def refresh(self) -> None:
        """Read what was appended; everything again when the file was replaced (thinned) or shrank."""
        try:
            stat = os.stat(self.path)
        except FileNotFoundError:
            self.groups, self._identity = [], None
            return
        if self._identity is None or self._identity[0] != stat.st_ino or stat.st_size < self._identity[1]:
            self.groups, self._identity = [], (stat.st_ino, 0)
        with open(self.path, "rb") as file:
            file.seek(self._identity[1])
            chunk = file.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is read next time
        self._identity = (stat.st_ino, self._identity[1] + len(complete))
        for line in complete.splitlines():
            if line.strip():
                self.groups.append(self._annotated(json.loads(line)))

    def _annotated(self, group: dict) -> dict:
        samples = group["samples"]
        rewards = [s["reward"] for s in samples]
        for sample, advantage in zip(samples, group_advantages(rewards, self.kind, self.algorithm), strict=True):
            if sample.get("advantage") is None and advantage is not None:
                sample["advantage"] = round(advantage, 4)
            logprobs = [lp for lp, m in zip(sample["logprobs"], sample["loss_mask"], strict=True) if m]
            sample["mean_logprob"] = round(sum(logprobs) / len(logprobs), 4) if logprobs else None
        group["reward_mean"] = sum(rewards) / len(rewards) if rewards else 0.0
        return group

    def summary(self) -> dict:
        """The run at a glance, and each version's groups, samples and mean reward (the page's step list)."""
        self.refresh()
        versions: dict[int, dict] = {}
        statuses: set[str] = set()
        rewards, staleness = [], []
        for group in self.groups:
            row = versions.setdefault(group["version"], {"version": group["version"], "groups": 0, "samples": 0,
                                                         "reward_sum": 0.0})
            row["groups"] += 1
            for sample in group["samples"]:
                row["samples"] += 1
                row["reward_sum"] += sample["reward"]
                statuses.add(sample["status"])
                rewards.append(sample["reward"])
                if sample.get("staleness") is not None:
                    staleness.append(sample["staleness"])
        steps = [{"version": v["version"], "groups": v["groups"], "samples": v["samples"],
                  "reward_mean": round(v["reward_sum"] / max(v["samples"], 1), 4)}
                 for v in sorted(versions.values(), key=lambda v: v["version"])]
        return {
            "run_dir": str(self.run_dir.resolve()), "name": self.run_dir.resolve().name, "log": str(self.path),
            "exists": self.path.exists(), "bytes": self._identity[1] if self._identity else 0,
            "groups": len(self.groups), "samples": sum(s["samples"] for s in steps),
            "kinds": sorted({g.get("kind", "group") for g in self.groups}),
            "stride": max((g.get("stride", 1) for g in self.groups), default=None),
            "statuses": sorted(statuses), "reward_range": [min(rewards), max(rewards)] if rewards else None,
            "staleness_range": [min(staleness), max(staleness)] if staleness else None,
            "advantage": ESTIMATOR_TEXT.get(self.kind, "not known for this run's algorithm"), "steps": steps,
        }

    def query(self, version: int | None, filters: Filters, offset: int = 0, limit: int = 20) -> dict:
        """The groups of `version` (None: every version) with a sample the filters admit, `limit` from `offset`;
        each with only its admitted samples (`hidden`: how many the filters left out)."""
        self.refresh()
        shown = []
        for group in self.groups:
            if version is not None and group["version"] != version:
                continue
            samples = [s for s in group["samples"] if filters.admits(group, s)]
            if samples:
                shown.append({**group, "samples": samples, "hidden": len(group["samples"]) - len(samples)})
        return {"total": len(shown), "offset": offset, "groups": shown[offset:offset + limit]}
