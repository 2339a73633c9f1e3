"""A served LLM judge: a real rollout process serves a tiny model over its OpenAI endpoint, a real reward
process scores through it. The logprob score is P(yes) / (P(yes) + P(no)) as transformers computes it on the
same prompt; a written verdict is parsed (or scores 0, counted); an unreachable judge fails its samples with
a clear reason while the service keeps serving; the experiment file takes a `judge` section."""

import asyncio
import json
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
import torch
import yaml
from test_reward_service import COMPLETED, FAILED, sample_proto
from transformers import AutoModelForCausalLM, AutoTokenizer
from user_project import experiment

from deploy.experiment.schema import load_experiment
from deploy.inspect.doctor import Finding, check_judge
from deploy.local.service_process import start_service
from deploy.rl.plan import reward_service
from protos import reward_pb2, reward_pb2_grpc
from protos.sample import Sample, SampleStatus
from reward.judge import Judge, JudgeConfig, read_verdict, render, yes_probability
from reward.scorer import Scorer, ScorerSettings
from reward.service import Config, build_registry
from services.client import connect_sync
from services.config import ConfigError

torch.set_num_threads(1)
MODEL = "judge"
TEMPLATE = "Q: {prompt}\nA: {response}\nExpected: {answer}\nCorrect? "
SAMPLES = [("what is 2+2?", "4", "4"), ("capital of France?", "Paris", "Paris"), ("3*3?", "10", "9")]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def judge_url(sharp_model_dir, tmp_path_factory):
    """A relayrl rollout process serving the (sharpened) tiny model as the judge."""
    port = closed_port()
    service = start_service("rollout", {
        "model": str(sharp_model_dir), "engine.max_model_len": 512, "engine.torch_threads": 1,
        "openai.port": port, "openai.served_model_name": MODEL, "openai.max_logprobs": 128,
    }, log_dir=tmp_path_factory.mktemp("judge-logs"))
    yield f"http://127.0.0.1:{port}/v1"
    service.stop(timeout=10)


@pytest.fixture(scope="module")
def reward(judge_url, tmp_path_factory):
    """The reward service with judges: logprob, generate, one never parsed, one unreachable."""
    base = {"url": judge_url, "model": MODEL, "template": TEMPLATE}
    judges = {
        "judge_lp": {**base, "yes": "y", "no": "n", "top_logprobs": 128},
        "judge_gen": {**base, "mode": "generate", "max_tokens": 8, "pattern": r"(\d)", "score_range": [-1, 1]},
        "judge_strict": {**base, "mode": "generate", "max_tokens": 4, "pattern": r"VERDICT=(\d+)"},
        "judge_down": {**base, "url": f"http://127.0.0.1:{closed_port()}/v1", "retries": 1, "backoff_s": 0.05},
    }
    svc = start_service("reward", {"max_concurrency": 1, "server.metrics_port": 0, "judges": judges},
                        log_dir=tmp_path_factory.mktemp("reward-judge-logs"))
    channel = connect_sync(svc.address)
    yield svc, reward_pb2_grpc.RewardStub(channel)
    channel.close()
    svc.stop(timeout=10)


def score(stub, function: str) -> list[reward_pb2.ScoreResult]:
    samples = [sample_proto(i, response, prompt, answer=answer) for i, (prompt, response, answer) in enumerate(SAMPLES)]
    reply = stub.Score(reward_pb2.ScoreRequest(function=function, samples=samples, timeout_s=60), timeout=120)
    return list(reply.results)


def rendered(i: int) -> str:
    prompt, response, answer = SAMPLES[i]
    return TEMPLATE.replace("{prompt}", prompt).replace("{response}", response).replace("{answer}", answer)


# ---- the pieces on their own


def test_render_fills_once_and_verdicts_parse():
    empty = np.zeros(0)
    sample = Sample("s", "p", empty.astype("int32"), empty.astype("int32"), empty.astype("uint8"),
                    empty.astype("float32"), empty.astype("int64"), prompt_text="say {response}",
                    response_text="ok {a}", metadata={"answer": [1, 2]})
    assert render("{prompt}|{response}|{answer}|{other}", sample) == "say {response}|ok {a}|1 | 2|{other}"
    assert read_verdict("score 3, no: final score 8", r"(\d+)", (0, 10)) == 0.8
    assert read_verdict("Rating: 12/10", r"Rating: (\d+)", (0, 10)) == 1.0
    assert read_verdict("no number here", r"(-?\d+(?:\.\d+)?)", (0, 10)) is None
    assert yes_probability({" Yes": np.log(0.3), "yes": np.log(0.1), "No": np.log(0.2), "x": 0.0}, "yes", "no") \
        == pytest.approx((0.4, 0.2))
    with pytest.raises(ValueError, match="response"):
        JudgeConfig(url="http://x/v1", model="m", template="{prompt} only")
    with pytest.raises(ValueError, match="score_range"):
        JudgeConfig(url="http://x/v1", model="m", template="{response}", score_range=(1, 1))


class FakeJudge(BaseHTTPRequestHandler):
    """Answers each completion after `delay` seconds: the next of `statuses` (an error body), once they are
    used up 200 with the verdict "8". Counts requests, and the most in flight at once."""

    delay, statuses, requests, in_flight, most_in_flight = 0.0, [], 0, 0, 0
    lock = threading.Lock()

    def do_POST(self):
        cls = type(self)
        with cls.lock:
            cls.requests += 1
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
            status = cls.statuses.pop(0) if cls.statuses else 200
        try:
            self.rfile.read(int(self.headers["Content-Length"]))
            time.sleep(cls.delay)
            error = {"error": {"message": f"fake {status}"}}
            body = json.dumps({"choices": [{"text": "8"}]} if status == 200 else error).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the judge gave up on it at the sample's timeout
        finally:
            with cls.lock:
                cls.in_flight -= 1

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_judge():
    """score(n, timeout_s, delay=, statuses=, **judge settings): n samples through a FakeJudge, in-process."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudge)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    empty = np.zeros(0)

    async def score_async(n: int, timeout_s: float, settings: dict) -> list:
        config = Config(judges={"fake": {"url": f"http://127.0.0.1:{server.server_port}/v1", "model": MODEL,
                                         "template": TEMPLATE, "mode": "generate", **settings}})
        judge = Judge("fake", config.judges["fake"])
        scorer = Scorer(build_registry(config), ScorerSettings(), judges={"fake": judge})  # never start()ed
        samples = [Sample(f"s{i}", "p", empty.astype("int32"), empty.astype("int32"), empty.astype("uint8"),
                          empty.astype("float32"), empty.astype("int64"), prompt_text="q", response_text="a")
                   for i in range(n)]
        try:
            return await scorer.score(samples, scorer.resolve("fake"), {}, timeout_s)
        finally:
            await judge.close()

    def score(n: int, timeout_s: float, delay: float = 0.0, statuses: tuple = (), **settings) -> list:
        FakeJudge.delay, FakeJudge.statuses = delay, [*statuses]
        FakeJudge.requests = FakeJudge.most_in_flight = 0
        return asyncio.run(score_async(n, timeout_s, settings))

    yield score
    server.shutdown()
    server.server_close()


def test_timeout_counts_from_a_free_slot_and_the_limit_holds(fake_judge):
    """Five samples through a judge with 2 slots, 0.3 s a verdict, 0.5 s per sample: the last ones wait
    ~0.6 s for a slot and still complete; at most 2 requests are in flight; a slower verdict times out."""
    outcomes = fake_judge(5, 0.5, delay=0.3, max_concurrency=2, retries=0)
    assert [(o.status, o.reward) for o in outcomes] == [(SampleStatus.COMPLETED, 0.8)] * 5
    assert FakeJudge.most_in_flight == 2
    late = fake_judge(5, 0.5, delay=0.8, max_concurrency=2, retries=0)
    assert all(o.status == SampleStatus.FAILED for o in late)
    assert late[0].reason.startswith("timeout after 0.5s waiting for judge 'fake' at http://127.0.0.1:")


def test_retries_what_a_retry_may_fix_with_backoff(fake_judge):
    """503 and 429 are retried after 0.1 s, then 0.2 s; a 400 is not; used-up retries give the last error."""
    started = time.perf_counter()
    [recovered] = fake_judge(1, 5.0, statuses=(503, 429), retries=2, backoff_s=0.1)
    assert (recovered.status, recovered.reward, FakeJudge.requests) == (SampleStatus.COMPLETED, 0.8, 3)
    assert time.perf_counter() - started >= 0.3
    [refused] = fake_judge(1, 5.0, statuses=(400,), retries=2, backoff_s=0.1)
    assert (refused.status, FakeJudge.requests) == (SampleStatus.FAILED, 1)
    assert "judge 'fake' refused the request (HTTP 400" in refused.reason and "fake 400" in refused.reason
    [gave_up] = fake_judge(1, 5.0, statuses=(503, 503, 502), retries=2, backoff_s=0.01)
    assert (gave_up.status, FakeJudge.requests) == (SampleStatus.FAILED, 3)
    assert "did not answer after 3 attempt(s): HTTP 502: fake 502" in gave_up.reason


# ---- the endpoint's top-k alternatives


def test_completions_serve_top_logprobs(judge_url):
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "temperature": 0, "logprobs": 5}
    reply = httpx.post(f"{judge_url}/completions", json=body, timeout=60).json()["choices"][0]
    tops, sampled = reply["logprobs"]["top_logprobs"], reply["logprobs"]["token_logprobs"]
    assert len(tops) == 2 and all(len(top) == 5 for top in tops)
    for top, token, logprob in zip(tops, reply["logprobs"]["tokens"], sampled):  # greedy: the sampled token leads
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4) and top[token] == max(top.values())
    for bad, named in (({**body, "stream": True}, "not streamed"), ({**body, "logprobs": 129}, "at most 128")):
        refused = httpx.post(f"{judge_url}/completions", json=bad, timeout=60)
        assert refused.status_code == 400 and named in refused.json()["error"]["message"]


# ---- the judge through the reward service


def test_logprob_score_is_p_yes_over_p_yes_plus_no(reward, sharp_model_dir):
    _, stub = reward
    results = score(stub, "judge_lp")
    tokenizer = AutoTokenizer.from_pretrained(sharp_model_dir)
    model = AutoModelForCausalLM.from_pretrained(sharp_model_dir, torch_dtype=torch.float32).eval()
    texts = [tokenizer.decode([i]).strip().lower() for i in range(len(tokenizer))]
    for i, result in enumerate(results):
        ids = tokenizer(rendered(i)).input_ids
        with torch.no_grad():
            probs = model(torch.tensor([ids])).logits[0, -1].float().softmax(-1)[:len(texts)]
        p_yes = sum(p for p, t in zip(probs.tolist(), texts) if t == "y")
        p_no = sum(p for p, t in zip(probs.tolist(), texts) if t == "n")
        assert result.status == COMPLETED, result.reason
        assert result.reward == pytest.approx(p_yes / (p_yes + p_no), abs=1e-4)
        assert result.details["judge_p_yes"] == pytest.approx(p_yes, abs=1e-4)
    assert len({round(r.reward, 6) for r in results}) == len(results)  # continuous: each sample its own score


def test_generate_mode_reads_the_verdict(reward, judge_url):
    _, stub = reward
    readings = []
    for i, result in enumerate(score(stub, "judge_gen")):
        body = {"model": MODEL, "prompt": rendered(i), "max_tokens": 8, "temperature": 0}
        verdict = httpx.post(f"{judge_url}/completions", json=body, timeout=60).json()["choices"][0]["text"]
        expected = read_verdict(verdict, r"(\d)", (-1, 1))  # a digit 0 reads 0.5
        assert result.status == COMPLETED, result.reason
        assert result.reward == pytest.approx(expected or 0.0)
        assert ("judge_unparsed" in result.details) == (expected is None)
        readings.append(expected)
    assert any(r is not None for r in readings)  # the fixed tiny judge writes a digit for some of them


def test_unparsed_verdict_scores_zero_and_is_counted(reward):
    svc, stub = reward
    results = score(stub, "judge_strict")
    assert all(r.status == COMPLETED and r.reward == 0.0 and r.details["judge_unparsed"] == 1.0 for r in results)
    assert all("unparsed verdict" in r.reason for r in results)
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{svc.metrics_port}/metrics", timeout=10).read().decode()
    assert 'relayrl_reward_judge_unparsed_total{function="judge_strict"} 3.0' in metrics


def test_unreachable_judge_fails_its_samples_and_the_service_keeps_serving(reward):
    _, stub = reward
    results = score(stub, "judge_down")
    assert all(r.status == FAILED and r.reward == 0.0 for r in results)
    assert "judge 'judge_down'" in results[0].reason and "did not answer after 2 attempt(s)" in results[0].reason
    assert "ConnectError" in results[0].reason
    assert {"judge_lp", "judge_down"} <= set(stub.ListFunctions(reward_pb2.ListFunctionsRequest(), timeout=10).names)
    assert all(r.status == COMPLETED for r in score(stub, "judge_lp"))


# ---- the experiment file and the doctor


def test_a_judge_request_fits_in_the_sample_timeout_and_args_beside_a_judge_or_model_are_errors(tmp_path):
    """The judge's 30 s request timeout sat inside a 10 s sample timeout (a retry never happened), and reward.args
    beside `judge` or `model` were dropped without a word."""
    from pydantic import ValidationError

    judge = {"url": "http://127.0.0.1:9/v1", "model": MODEL, "template": TEMPLATE}
    spec, path = experiment(tmp_path, tmp_path / "run"), tmp_path / "experiment.yaml"

    def load(reward: dict):
        spec["reward"] = reward
        path.write_text(yaml.safe_dump(spec))
        return load_experiment(path)

    config = load({"judge": judge})
    assert config.reward.judge.timeout_s < config.reward.timeout_s  # the defaults fit
    assert JudgeConfig(**judge).timeout_s < Config().default_timeout_s
    with pytest.raises(ConfigError, match=r"judge.timeout_s \(10s per request\) must be below timeout_s \(10s"):
        load({"judge": {**judge, "timeout_s": 10}})
    with pytest.raises(ValidationError, match=r"judges.j.timeout_s \(30s per request\) must be below default_timeout_s"):
        Config(judges={"j": {**judge, "timeout_s": 30}})
    with pytest.raises(ConfigError, match="args: judge is set"):
        load({"judge": judge, "args": {"bonus": 1.0}})
    with pytest.raises(ConfigError, match="args: model is set"):
        load({"model": str(tmp_path / "rm"), "args": {"bonus": 1.0}})
    assert load({"model": str(tmp_path / "rm")}).reward.args == {}


def test_experiment_takes_a_judge_section_and_the_doctor_checks_it(tmp_path, judge_url):
    spec = experiment(tmp_path, tmp_path / "run")
    spec["reward"] = {"judge": {"url": judge_url, "model": MODEL, "template": TEMPLATE, "mode": "logprob"}}
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(spec))
    config = load_experiment(path)
    overrides, _, name = reward_service(config)
    assert overrides[f"judges.{name}"]["url"] == judge_url and overrides[f"judges.{name}"]["mode"] == "logprob"

    findings: list[Finding] = []
    check_judge(config.reward.judge, findings)
    assert [f.level for f in findings] == ["ok"]
    down = config.reward.judge.model_copy(update={"url": f"http://127.0.0.1:{closed_port()}/v1"})
    wrong = config.reward.judge.model_copy(update={"model": "other"})
    findings = []
    check_judge(down, findings)
    check_judge(wrong, findings)
    assert [f.level for f in findings] == ["error", "error"]
    assert "unreachable" in findings[0].message and "does not serve 'other'" in findings[1].message

    spec["reward"]["model"] = str(tmp_path / "rm")
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(ConfigError, match="model and judge"):
        load_experiment(path)
