"""`relayrl view RUN_DIR` (deploy/inspect/view.py, deploy/inspect/trajectories.py): the JSON API the page uses, over a trajectory log
written by the real writer (rollout/driver/trajectory_log.py): steps, advantages, filters, search, episodes, a log
that grows or is thinned while the page is open; and the page itself, which fetches nothing from elsewhere."""

import json
import pathlib
import re

import numpy as np
import pytest
import yaml
from fastapi.testclient import TestClient

from deploy.cli import build_parser
from deploy.inspect.view import PAGE, create_app
from protos.sample import Sample, SampleStatus
from rollout.driver.trajectory_log import TrajectoryLog, TrajectoryLogConfig, group_record

REWARDS = {0: [1.0, 0.0, 0.0, 1.0], 1: [1.0, 1.0, 1.0, 0.0], 2: [0.0, 0.0, 0.0, 0.0]}  # by group index


def completion(group: int, index: int, reward: float, version: int, status=SampleStatus.COMPLETED) -> Sample:
    text = f"answer {group}{index}"
    n = len(text)
    return Sample(sample_id=f"p{group}#x.{group}/{index}", prompt_id=f"p{group}", group_id=f"p{group}#x.{group}",
                  group_size=4, prompt_ids=np.array([1, 2, 3], np.int32),
                  response_ids=np.array([ord(c) for c in text], np.int32), loss_mask=np.ones(n, np.uint8),
                  rollout_logprobs=np.linspace(-3, 0, n, dtype=np.float32),
                  weight_versions=np.full(n, version, np.int64), reward=reward, status=status,
                  prompt_text=f"prompt {group}", response_text=text, metadata={"answer": str(group)})


def episode(index: int, reward: float) -> Sample:
    call = '<tool_call>{"name": "calc", "arguments": {"expr": "12*34"}}</tool_call>'
    ids = list(range(10, 20))
    return Sample(sample_id=f"12*34#x.3/{index}", prompt_id="12*34", group_id="12*34#x.3", group_size=2,
                  prompt_ids=np.array([1], np.int32), response_ids=np.array(ids, np.int32),
                  loss_mask=np.array([1] * 4 + [0] * 3 + [1] * 3, np.uint8), rollout_logprobs=np.zeros(10, np.float32),
                  weight_versions=np.full(10, 2, np.int64), reward=reward, prompt_text="user: 12*34",
                  response_text=call + "408408", metadata={"solved": bool(reward)}), {
        "turns": [{"role": "assistant", "text": call, "content": "",
                   "tool_calls": [{"name": "calc", "arguments": {"expr": "12*34"}}]},
                  {"role": "environment", "messages": [{"role": "tool", "content": "408"}], "reward": 0.0,
                   "done": False},
                  {"role": "assistant", "text": "408", "content": "408", "tool_calls": []},
                  {"role": "environment", "messages": [], "reward": reward, "done": True}]}


def write_run(run_dir: pathlib.Path, algorithm: dict | None = None) -> pathlib.Path:
    """A run folder: its config.yaml and a trajectory log of three driver groups and one group of episodes."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"algorithm": algorithm or {"name": "grpo"}}))
    log = TrajectoryLog(TrajectoryLogConfig(path=str(run_dir / "trajectories.jsonl"), every_n_groups=1))
    for group, rewards in REWARDS.items():
        version = 1 if group < 2 else 2
        samples = [completion(group, i, r, version, SampleStatus.TRUNCATED if i == 3 else SampleStatus.COMPLETED)
                   for i, r in enumerate(rewards)]
        log.offer(group, lambda spell, s=samples: group_record("group", s, "x", 1, 1, spell, 0.0))
    played = [episode(0, 1.0), episode(1, 0.0)]
    log.offer(3, lambda spell: group_record("episodes", [s for s, _ in played], "x", 3, 2, spell, 0.0,
                                            prompt={"messages": [{"role": "user", "content": "12*34"}]},
                                            extra=[t for _, t in played]))
    log.close()
    return run_dir


@pytest.fixture
def client(tmp_path):
    return TestClient(create_app(write_run(tmp_path / "run")))


def test_the_run_and_its_steps(client):
    run = client.get("/api/run").json()
    assert run["groups"] == 4 and run["samples"] == 14 and run["kinds"] == ["episodes", "group"]
    assert [(s["version"], s["groups"], s["samples"]) for s in run["steps"]] == [(1, 2, 8), (2, 2, 6)]
    assert run["statuses"] == ["completed", "truncated"] and run["stride"] == 1
    assert run["advantage"].startswith("GRPO") and run["staleness_range"] == [0, 1]


def test_a_step_shows_its_groups_with_grpo_advantages(client):
    reply = client.get("/api/groups", params={"version": 1}).json()
    assert reply["total"] == 2 and [g["prompt_id"] for g in reply["groups"]] == ["p0", "p1"]
    first = reply["groups"][0]
    assert first["prompt"]["text"] == "prompt 0" and first["prompt"]["metadata"] == {"answer": "0"}
    sample = first["samples"][0]
    assert sample["text"] == "answer 00" and sample["ids"] == [ord(c) for c in "answer 00"]
    assert len(sample["logprobs"]) == len(sample["versions"]) == len(sample["loss_mask"]) == 9
    # rewards [1, 0, 0, 1]: mean 0.5, unbiased std 0.577 -> +-0.866
    assert [s["advantage"] for s in first["samples"]] == pytest.approx([0.866, -0.866, -0.866, 0.866], abs=1e-3)
    assert all(s["advantage"] == 0 for s in client.get("/api/groups", params={"version": 2}).json()["groups"][0]["samples"]
               if s["reward"] == 0.0)


def test_dr_grpo_and_rloo_advantages_follow_the_runs_algorithm(tmp_path):
    dr = TestClient(create_app(write_run(tmp_path / "dr", {"name": "grpo", "grpo_norm_std": False})))
    assert [s["advantage"] for s in dr.get("/api/groups", params={"version": 1}).json()["groups"][0]["samples"]] == [
        0.5, -0.5, -0.5, 0.5]
    rloo = TestClient(create_app(write_run(tmp_path / "rloo", {"name": "grpo", "advantage_estimator": "rloo"})))
    assert [s["advantage"] for s in rloo.get("/api/groups", params={"version": 1}).json()["groups"][0]["samples"]] == (
        pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3], abs=1e-3))
    ppo = TestClient(create_app(write_run(tmp_path / "ppo", {"name": "ppo"})))
    assert ppo.get("/api/run").json()["advantage"].startswith("not known")


def test_filters_by_reward_status_and_staleness(client):
    def shown(**params) -> list[str]:
        groups = client.get("/api/groups", params=params).json()["groups"]
        return [s["sample_id"].rsplit(".", 1)[1] for g in groups for s in g["samples"]]

    assert shown(min_reward=1) == ["0/0", "0/3", "1/0", "1/1", "1/2", "3/0"]
    assert shown(max_reward=0, version=1) == ["0/1", "0/2", "1/3"]
    assert shown(status="truncated") == ["0/3", "1/3", "2/3"]
    assert shown(status="completed", min_reward=1, version=1) == ["0/0", "1/0", "1/1", "1/2"]
    assert shown(min_staleness=1) == ["3/0", "3/1"]  # the episodes: trainer at 3, tokens of version 2
    assert shown(max_staleness=0, version=2) == ["2/0", "2/1", "2/2", "2/3"]
    group = client.get("/api/groups", params={"min_reward": 1, "version": 1}).json()["groups"][0]
    assert group["hidden"] == 2 and len(group["samples"]) == 2


def test_text_search_reaches_prompts_completions_and_turns(client):
    def groups(q: str) -> list[str]:
        return [g["prompt_id"] for g in client.get("/api/groups", params={"q": q}).json()["groups"]]

    assert groups("ANSWER 21") == ["p2"] and groups("prompt 1") == ["p1"]
    assert groups("408") == ["12*34"] and groups("calc") == ["12*34"] and groups("nowhere") == []


def test_episodes_come_turn_by_turn_with_tool_calls_and_observations(client):
    [group] = client.get("/api/groups", params={"version": 2, "q": "calc"}).json()["groups"]
    assert group["kind"] == "episodes" and group["prompt"]["messages"] == [{"role": "user", "content": "12*34"}]
    first = group["samples"][0]
    roles = [t["role"] for t in first["turns"]]
    assert roles == ["assistant", "environment", "assistant", "environment"]
    assert first["turns"][0]["tool_calls"] == [{"name": "calc", "arguments": {"expr": "12*34"}}]
    assert first["turns"][1]["messages"] == [{"role": "tool", "content": "408"}]
    assert first["loss_mask"] == [1] * 4 + [0] * 3 + [1] * 3


def test_pages_of_groups(client):
    first = client.get("/api/groups", params={"limit": 3}).json()
    rest = client.get("/api/groups", params={"limit": 3, "offset": 3}).json()
    assert first["total"] == rest["total"] == 4
    assert len(first["groups"]) == 3 and len(rest["groups"]) == 1
    assert client.get("/api/groups", params={"limit": 0}).status_code == 422


def test_the_page_sees_a_growing_log_and_a_thinned_one(tmp_path):
    run = write_run(tmp_path / "run")
    client = TestClient(create_app(run))
    assert client.get("/api/run").json()["groups"] == 4
    log = run / "trajectories.jsonl"
    lines = log.read_text().splitlines(keepends=True)
    with open(log, "a") as out:
        out.write(lines[0].replace('"group_index": 0', '"group_index": 4'))
        out.write(lines[1][:40])  # a line being written: not read yet
    assert client.get("/api/run").json()["groups"] == 5
    thinned = log.with_suffix(".new")
    thinned.write_text(lines[0] + lines[2])
    thinned.replace(log)  # as the writer thins: a new file
    assert client.get("/api/run").json()["groups"] == 2


def test_a_run_without_a_log_shows_an_empty_page(tmp_path):
    client = TestClient(create_app(tmp_path))
    run = client.get("/api/run").json()
    assert run["exists"] is False and run["groups"] == 0 and run["steps"] == []
    assert client.get("/api/groups").json() == {"total": 0, "offset": 0, "groups": []}


def test_the_page_and_its_assets_fetch_nothing_from_elsewhere(client):
    page = client.get("/")
    assert page.status_code == 200 and "/assets/view.js" in page.text and "/assets/view.css" in page.text
    assert client.get("/assets/view.js").headers["content-type"].startswith("text/javascript")
    assert client.get("/assets/secret.py").status_code == 404
    for path in PAGE.iterdir():
        assert not re.search(r"https?://|//cdn|@import", path.read_text()), path
    assert "innerHTML" not in (PAGE / "view.js").read_text()  # run text goes in as text, never as markup


def test_relayrl_view_parses_its_arguments(tmp_path):
    args = build_parser().parse_args(["view", str(tmp_path), "--port", "9001"])
    assert (args.command, args.run_dir, args.port, args.host) == ("view", str(tmp_path), 9001, "127.0.0.1")


def test_every_group_line_is_json_with_its_index_first(tmp_path):
    run = write_run(tmp_path / "run")
    for line in (run / "trajectories.jsonl").read_text().splitlines():
        assert line.startswith('{"group_index": ') and json.loads(line)["samples"]
