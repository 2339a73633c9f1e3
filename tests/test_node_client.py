"""The Node.js environment client (examples/node_env), written only against protos/*.proto, plays
guess-a-number sessions on a real rollout service process over loopback: its trajectory comes back
token-exact (generated turns and observations, loss mask 1 exactly on generated tokens), reaches a
real replay buffer as that same sample when submitted, and a bad call ends in a clean status message
and a nonzero exit, with the server still serving."""

import json
import pathlib
import re
import shutil
import subprocess

import grpc
import pytest

from protos import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_array
from rollout.model.tiny import char_tokenizer
from services.client import connect_sync

NODE = shutil.which("node")
NODE_ENV = pathlib.Path(__file__).resolve().parent.parent / "examples" / "node_env"
MALFORMED = "I could not read a number"
TURN_REWARDS = {"correct": 1.0, MALFORMED: -0.1}  # as in examples/node_env/guess.js
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed: the Node.js environment client needs it")


@pytest.fixture(scope="module")
def node_modules():
    """The pinned @grpc packages; `make test` installs them with `npm ci`, a bare pytest run does it here."""
    if not (NODE_ENV / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_ENV, check=True, timeout=300)


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    from deploy.local.service_process import start_service

    logs = tmp_path_factory.mktemp("buffer")
    service = start_service("buffer", {"data_dir": str(logs / "data"), "server.metrics_port": 0}, log_dir=logs)
    yield service
    service.stop(timeout=10)


@pytest.fixture(scope="module")
def rollout(tiny_model_dir, tmp_path_factory, node_modules, buffer):
    """A rollout service that submits closed sessions to `buffer` when asked."""
    from deploy.local.service_process import start_service

    service = start_service(
        "rollout",
        {"model": str(tiny_model_dir), "engine.max_model_len": 512, "engine.torch_threads": 1,
         "server.metrics_port": 0, "buffer": buffer.address},
        log_dir=tmp_path_factory.mktemp("rollout-logs"),
    )
    yield service
    service.stop(timeout=10)


def run_node(*args: str) -> subprocess.CompletedProcess:
    """game.js with `args`; its exit code is the caller's to check."""
    return subprocess.run([NODE, "game.js", *args], cwd=NODE_ENV, capture_output=True, text=True, timeout=120,
                          check=False)


def play(address: str, *args: str) -> dict:
    done = run_node("--address", address, "--trace", *args)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0])


def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
    return char_tokenizer().decode(ids, skip_special_tokens=skip_special_tokens)


def expected_feedback(tokens: list[int], secret: int) -> str:
    """What the game must answer to a reply (mirrors examples/node_env/guess.js)."""
    text = decode(tokens, skip_special_tokens=True)
    match = re.search(r"-?\d+", text)
    guess = int(match.group()) if match else None
    if guess is None or not 1 <= guess <= 100:
        return MALFORMED
    return "correct" if guess == secret else "higher" if guess < secret else "lower"


def check_trajectory(result: dict, max_turns: int) -> None:
    """The sample is the turns as the client saw them, token for token, with the right masks."""
    episode, sample = result["episode"], result["sample"]
    assert result["sample_ok"], result["sample_problems"]
    assert 1 <= result["turns"] == len(episode) <= max_turns and not result["truncated"]
    assert result["solved"] or result["turns"] == max_turns
    response, mask = [], []
    for turn in episode:
        assert len(turn["tokens"]) == len(turn["logprobs"]) == len(turn["weight_versions"]) >= 1
        response += turn["tokens"] + turn["observation"]
        mask += [1] * len(turn["tokens"]) + [0] * len(turn["observation"])
    assert sample["response_ids"] == response
    assert sample["loss_mask"] == mask
    assert len(sample["rollout_logprobs"]) == len(response)
    assert all((lp < 0) if m else (lp == 0) for lp, m in zip(sample["rollout_logprobs"], mask))
    generated = [lp for turn in episode for lp in turn["logprobs"]]
    assert [lp for lp, m in zip(sample["rollout_logprobs"], mask) if m] == generated
    assert result["response_tokens"] == len(response) == result["policy_tokens"] + result["masked_tokens"]
    assert result["policy_tokens"] == sum(mask) and result["weight_versions"] == [0]
    feedback = [expected_feedback(turn["tokens"], result["secret"]) for turn in episode]
    assert sample["turn_rewards"] == pytest.approx([TURN_REWARDS.get(f, 0.0) for f in feedback])
    assert result["malformed"] == feedback.count(MALFORMED)
    stats = result["stats"]
    assert stats["turns"] == result["turns"] and stats["kv_recomputes"] == 0
    # KV kept between turns: turn k prefills its observation (and the last token sampled), not the context. The
    # first turn prefills its prompt but for whole blocks (16 tokens) an earlier session's game prompt left cached.
    cached = result["prompt_tokens"] - stats["turn_prefill_tokens"][0]
    assert 0 <= cached < result["prompt_tokens"] and cached % 16 == 0
    for before, prefill in zip(episode, stats["turn_prefill_tokens"][1:]):
        assert prefill <= len(before["observation"]) + 1
    assert (result["reward"] > 0) == result["solved"]


def test_node_client_plays_chat_session_token_exact(rollout):
    result = play(rollout.address, "--seed", "3", "--max-turns", "4", "--max-tokens", "12")
    check_trajectory(result, max_turns=4)
    prompt = decode(result["sample"]["prompt_ids"])
    assert prompt.startswith("<bos>system\nI am thinking of a whole number from 1 to 100.")
    assert prompt.endswith("<eos>\n<bos>user\nYour guess?<eos>\n<bos>assistant\n")
    for turn in result["episode"]:
        observation = decode(turn["observation"])
        # A user message in the chat template, then the next assistant turn's generation prompt.
        assert f"<bos>user\n{expected_feedback(turn['tokens'], result['secret'])}" in observation
        assert observation.endswith("<eos>\n<bos>assistant\n")
    assert result["sample"]["temperature"] == pytest.approx(1.0)


def test_node_client_plain_text_session_is_reproducible(rollout):
    args = ("--format", "text", "--seed", "5", "--max-turns", "3", "--max-tokens", "8")
    first, second = play(rollout.address, *args), play(rollout.address, *args)
    check_trajectory(first, max_turns=3)
    assert decode(first["sample"]["prompt_ids"]).startswith("<bos>I am thinking")
    for turn in first["episode"]:
        assert expected_feedback(turn["tokens"], first["secret"]) in decode(turn["observation"])
    assert first["sample"]["response_ids"] == second["sample"]["response_ids"]
    assert first["session_id"] != second["session_id"]


def test_node_client_submits_a_group_the_buffer_hands_out_unchanged(rollout, buffer):
    results = [play(rollout.address, "--seed", str(seed), "--max-turns", "2", "--max-tokens", "8", "--submit",
                    "--group-id", "guess-group", "--group-size", "2") for seed in (7, 8)]
    assert all(result["submitted"] for result in results)
    with connect_sync(buffer.address) as channel:
        pull = buffer_pb2.PullRequest(batch_size=2, max_batches=1, consumer="test_node_client")
        [batch] = list(buffer_pb2_grpc.BufferStub(channel).Pull(pull, timeout=30))
    by_id = {sample.sample_id: sample for sample in batch.samples}
    assert sorted(by_id) == sorted(result["session_id"] for result in results)
    for result in results:
        stored, seen = by_id[result["session_id"]], result["sample"]
        assert (stored.group_id, stored.group_size, stored.prompt_id) == ("guess-group", 2, "guess-group")
        assert decode_array(stored.response_ids).tolist() == seen["response_ids"]
        assert decode_array(stored.loss_mask).tolist() == seen["loss_mask"]
        assert decode_array(stored.rollout_logprobs).tolist() == seen["rollout_logprobs"]
        assert stored.reward == result["reward"]
        assert dict(stored.reward_details) == {"solved": result["solved"], "turns": result["turns"],
                                               "malformed": result["malformed"]}


def test_node_client_reports_bad_calls_cleanly(rollout, free_port):
    unknown = run_node("--address", rollout.address, "--close", "no-such-session")
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert unknown.stderr.startswith("game.js: CloseSession failed: NOT_FOUND (5): ")
    assert "no-such-session" in unknown.stderr and "    at " not in unknown.stderr  # a message, not a stack trace

    with connect_sync(rollout.address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        stub.OpenSession(rollout_pb2.OpenSessionRequest(session_id="taken", prompt_text="hi"), timeout=30)
        duplicate = run_node("--address", rollout.address, "--session-id", "taken")
        assert duplicate.returncode == 1
        assert duplicate.stderr.startswith("game.js: OpenSession failed: ALREADY_EXISTS (6): ")
        closed = run_node("--address", rollout.address, "--close", "taken")
        assert closed.returncode == 0, closed.stderr
        assert json.loads(closed.stdout) == {"session_id": "taken", "closed": True, "prompt_tokens": 2,
                                             "response_tokens": 0}
        with pytest.raises(grpc.RpcError) as gone:
            stub.CloseSession(rollout_pb2.CloseSessionRequest(session_id="taken"), timeout=30)
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND

    unreachable = run_node("--address", f"127.0.0.1:{free_port}", "--timeout", "5")
    assert unreachable.returncode == 1 and "OpenSession failed: UNAVAILABLE (14)" in unreachable.stderr
    usage = run_node("--address", rollout.address, "--max-turns", "0")
    assert usage.returncode == 2 and "--max-turns" in usage.stderr
    # The server kept serving through all of that.
    check_trajectory(play(rollout.address, "--max-turns", "1"), max_turns=1)
