"""The OpenAI-compatible endpoint: a real rollout process serving it beside gRPC, called with the official
`openai` package (and httpx for raw bodies); plus the tool-call parser and the choice assembly on their own,
and an in-process app for a stopped engine and sessions keyed by API key."""

import json
import socket

import httpx
import numpy as np
import openai
import pytest
import torch
from transformers import AutoTokenizer

from protos import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_array, encode_array
from rollout.engine.outputs import Completion
from rollout.engine.sequence import FinishReason
from rollout.serve.chat import render_continuation, render_prompt
from rollout.serve.openai_output import Choice
from rollout.serve.tool_calls import ToolCall, ToolCallParser, split_tool_calls
from services.client import connect

torch.set_num_threads(1)
MODEL = "tiny"
ASK = [{"role": "user", "content": "what is 12*34?"}]
CALCULATOR = [{"type": "function", "function": {
    "name": "multiply",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


@pytest.fixture(scope="module")
def endpoint(tiny_model_dir, tmp_path_factory):
    """A rollout process with the endpoint on, and the buffer it submits to: (gRPC address, HTTP base url,
    buffer address)."""
    from deploy.local.service_process import start_service

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    logs = tmp_path_factory.mktemp("openai-logs")
    buffer = start_service("buffer", {"data_dir": str(tmp_path_factory.mktemp("openai-buffer"))}, log_dir=logs)
    service = start_service("rollout", {
        "model": str(tiny_model_dir), "engine.max_model_len": 512, "engine.torch_threads": 1,
        "engine.max_sessions": 3, "openai.port": port, "openai.served_model_name": MODEL, "buffer": buffer.address,
    }, log_dir=logs)
    yield service.address, f"http://127.0.0.1:{port}/v1", buffer.address
    service.stop(timeout=10)
    buffer.stop(timeout=10)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def client(base_url: str, **kwargs) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=60, **kwargs)


@pytest.fixture
async def api(endpoint):
    async with client(endpoint[1]) as api:
        yield api


async def grpc_generate(address: str, prompt: list[int] | str, **params) -> rollout_pb2.Completion:
    """The first completion gRPC Generate gives for `prompt` (token ids or text)."""
    given = {"prompt_text": prompt} if isinstance(prompt, str) else {"prompt_ids": encode_array(prompt, "int32")}
    async with connect(address) as channel:
        reply = await rollout_pb2_grpc.RolloutStub(channel).Generate(rollout_pb2.GenerateRequest(
            params=rollout_pb2.SamplingParams(logprobs=True, **params), **given), timeout=60)
    return reply.completions[0]


# ---- the parser and the choice assembly, on their own


def tag(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


@pytest.mark.parametrize("text,content,calls", [
    (tag('{"name": "multiply", "arguments": {"a": 12, "b": 34}}'), "", [("multiply", {"a": 12, "b": 34})]),
    ("let me compute." + tag('{"name": "f", "arguments": {}}') + tag('{"name": "g", "arguments": {"x": [1]}}'),
     "let me compute.", [("f", {}), ("g", {"x": [1]})]),
    (tag('{"name": "f", "arguments": {"a": 1}'), tag('{"name": "f", "arguments": {"a": 1}'), []),  # invalid JSON
    (tag('{"name": "f", "arguments": "a=1"}'), tag('{"name": "f", "arguments": "a=1"}'), []),  # not an object
    ('<tool_call>{"name": "f", "arguments": {}}', '<tool_call>{"name": "f", "arguments": {}}', []),  # never closed
    ("a < b <tool", "a < b <tool", []),  # a tail that looked like a tag
])
def test_tool_calls_parse_whole_and_streamed_alike(text, content, calls):
    whole_content, whole_calls = split_tool_calls(text)
    assert (whole_content, [(c.name, c.arguments) for c in whole_calls]) == (content, calls)
    parser = ToolCallParser()
    pieces = [piece for char in text for piece in parser.feed(char)] + parser.finish()
    assert "".join(p for p in pieces if isinstance(p, str)) == content
    assert [(p.name, p.arguments) for p in pieces if isinstance(p, ToolCall)] == calls
    assert all(json.loads(c.to_openai()["function"]["arguments"]) == c.arguments for c in whole_calls)


def test_a_choice_cuts_stop_strings_and_parses_tool_calls_from_tokens(tokenizer):
    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)

    def run(text: str, stops=(), tools=False, step=3):
        ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        choice = Choice(0, decode, stops, ToolCallParser() if tools else None)
        streamed = []
        for at in range(0, len(ids), step):
            last = at + step >= len(ids)
            delta = Completion(0, ids[at:at + step], [-1.0] * len(ids[at:at + step]), [0] * len(ids[at:at + step]),
                               FinishReason.STOP if last else None)
            streamed += choice.take(delta).pieces
        assert choice.token_ids == ids  # the tokens stay exactly as generated
        return choice, streamed

    choice, streamed = run('I will call.<tool_call>{"name": "multiply", "arguments": {"a": 12}}</tool_call>', tools=True)
    assert choice.content_and_calls()[0] == "I will call." and isinstance(streamed[-1], ToolCall)
    assert "".join(streamed[:-1]) == "I will call."  # content streams in pieces; the call comes whole
    assert [(c.name, c.arguments) for c in choice.content_and_calls()[1]] == [("multiply", {"a": 12})]
    assert choice.openai_finish_reason == "tool_calls"
    choice, streamed = run("Thought: go\nObservation: x", stops=("Observation:",), step=2)
    assert choice.content_and_calls() == ("Thought: go\n", []) and "O" not in "".join(streamed)
    assert choice.openai_finish_reason == "stop"
    choice, _ = run('<tool_call>{"name": "multiply", "arguments": {"a": 12}}</tool_call>', tools=False)
    assert choice.content_and_calls()[0].startswith("<tool_call>")  # no tools in the request: plain content


def _byte_level_tokenizer():
    """A byte-level BPE whose multi-byte characters (accents, CJK, emoji) span several tokens."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["the cat sat on the mat. " * 20, "héllo wörld"], vocab_size=300, min_frequency=2,
                            show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


def test_streaming_decodes_each_token_a_bounded_number_of_times_and_equals_the_whole_decode():
    """Incremental detokenisation: streaming a completion token by token decodes O(tokens), not O(tokens^2), and
    its text (held back while a character is incomplete) equals decoding the whole completion at once."""
    tokenizer = _byte_level_tokenizer()
    text = "the cat sat on the mat. héllo wörld 日本語 🙂 " * 12
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > 200
    decoded_tokens = []

    def decode(part):
        decoded_tokens.append(len(part))
        return tokenizer.decode(part, skip_special_tokens=True)

    choice = Choice(0, decode, ("STOP",), None)
    streamed = []
    for at, token in enumerate(ids):
        last = at == len(ids) - 1
        pieces = choice.take(Completion(0, [token], [-1.0], [0], FinishReason.LENGTH if last else None)).pieces
        streamed += pieces
        assert all("\ufffd" not in piece for piece in pieces)  # no half character is ever sent
    assert "".join(streamed) == tokenizer.decode(ids, skip_special_tokens=True)
    assert sum(decoded_tokens) <= 12 * len(ids), (sum(decoded_tokens), len(ids))  # was len(ids)**2 / 2


def test_a_session_takes_only_a_continuation_of_its_history():
    from rollout.serve.openai_schema import ChatMessage
    from rollout.serve.openai_sessions import ChatSession, HistoryDiverged

    def keys(*messages):
        return [ChatMessage(**m).key() for m in messages]

    ask = {"role": "user", "content": "12*34?"}
    call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_a", "function": {"name": "multiply", "arguments": '{"a": 12, "b": 34}'}}]}
    resent = {"role": "assistant", "content": "", "tool_calls": [  # another id, arguments as an object
        {"id": "call_b", "type": "function", "function": {"name": "multiply", "arguments": {"b": 34, "a": 12}}}]}
    result = {"role": "tool", "tool_call_id": "call_b", "content": "408"}
    session = ChatSession("k", keys(ask), num_tokens=10)
    assert session.new_messages(keys(ask)) is None  # the first turn is still owed: a retry
    session.replied(keys(ask), keys(call)[0], reply_tokens=4, turn_closed=True)
    assert session.new_messages(keys(ask, resent, result)) == 2
    for diverged in (keys(ask), keys(ask, resent), keys(ask, {**call, "content": "x"}, result), keys(result)):
        with pytest.raises(HistoryDiverged, match="the history diverged"):
            session.new_messages(diverged)
    session.check_tokens(14)
    with pytest.raises(HistoryDiverged, match="client left"):
        session.check_tokens(15)


def test_the_endpoint_stays_on_loopback_unless_told():
    from rollout.serve.openai_schema import OpenAISettings

    with pytest.raises(ValueError, match="no auth"):
        OpenAISettings(host="0.0.0.0")
    assert OpenAISettings(host="0.0.0.0", insecure=True).host == "0.0.0.0"


# ---- the real process


async def test_chat_and_completions_equal_grpc_generate(endpoint, api, tokenizer):
    address, *_ = endpoint
    models = await api.models.list()
    assert [m.id for m in models.data] == [MODEL]
    chat = await api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=12, temperature=1.0, seed=7,
                                             logprobs=True, extra_body={"ignore_eos": True})
    prompt = render_prompt(tokenizer, ASK)
    reference = await grpc_generate(address, prompt, max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    [choice] = chat.choices
    assert choice.token_ids == decode_array(reference.token_ids).tolist()
    np.testing.assert_allclose([t.logprob for t in choice.logprobs.content], decode_array(reference.logprobs),
                               atol=1e-6)
    assert [t.token for t in choice.logprobs.content] == [tokenizer.decode([t]) for t in choice.token_ids]
    assert choice.weight_versions == [0] * 12 and choice.finish_reason == "length"
    assert choice.message.content == reference.text and choice.message.role == "assistant"
    assert chat.usage.prompt_tokens == len(prompt) and chat.usage.completion_tokens == 12

    text = await api.completions.create(model=MODEL, prompt="12+34=", max_tokens=8, temperature=0.5, seed=3, n=2,
                                        logprobs=0, extra_body={"ignore_eos": True})
    reference = await grpc_generate(address, "12+34=", max_tokens=8, temperature=0.5, seed=3, n=2, ignore_eos=True)
    assert text.choices[0].token_ids == decode_array(reference.token_ids).tolist()
    np.testing.assert_allclose(text.choices[0].logprobs.token_logprobs, decode_array(reference.logprobs), atol=1e-6)
    assert text.choices[0].text == reference.text and len(text.choices) == 2
    by_ids = await api.completions.create(model=MODEL, prompt=tokenizer("12+34=").input_ids, max_tokens=8,
                                          temperature=0.5, seed=3, extra_body={"ignore_eos": True})
    assert by_ids.choices[0].token_ids == text.choices[0].token_ids


async def test_streaming_gives_the_same_reply_in_chunks(endpoint, api):
    request = {"model": MODEL, "messages": ASK, "max_tokens": 20, "seed": 11, "extra_body": {"ignore_eos": True}}
    free = (await api.chat.completions.create(**request)).choices[0]
    stop = free.message.content[5]  # a stop string the reply is known to reach
    request["stop"] = [stop]
    whole = await api.chat.completions.create(**request)
    assert whole.choices[0].message.content == free.message.content[:free.message.content.index(stop)]
    assert whole.choices[0].token_ids == free.token_ids[:len(whole.choices[0].token_ids)]  # the stop token kept
    assert whole.choices[0].finish_reason == "stop"
    chunks = [c async for c in await api.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True})]
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert deltas[0].delta.role == "assistant"
    assert "".join(d.delta.content or "" for d in deltas) == whole.choices[0].message.content
    assert [t for d in deltas for t in d.token_ids] == whole.choices[0].token_ids
    assert deltas[-1].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == len(whole.choices[0].token_ids)

    stream = await api.completions.create(model=MODEL, prompt="hello", max_tokens=10, seed=2, stream=True,
                                          extra_body={"ignore_eos": True})
    pieces = [c.choices[0] async for c in stream]
    assert sum(len(p.token_ids) for p in pieces) == 10 and pieces[-1].finish_reason == "length"


async def test_tools_reach_the_template_and_replies_carry_openai_fields(endpoint, api, tokenizer):
    history = ASK + [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "multiply", "arguments": json.dumps({"a": 12, "b": 34})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "408"},
    ]
    for messages in (ASK, history):
        reply = await api.chat.completions.create(model=MODEL, messages=messages, tools=CALCULATOR, max_tokens=24,
                                                  seed=5)
        assert reply.usage.prompt_tokens == len(render_prompt(tokenizer, messages, CALCULATOR))
        [choice] = reply.choices
        assert choice.finish_reason in ("stop", "length", "tool_calls")
        assert choice.message.tool_calls is None or all(
            isinstance(json.loads(c.function.arguments), dict) for c in choice.message.tool_calls)
        assert len(choice.token_ids) == len(choice.weight_versions) == reply.usage.completion_tokens
    # the prompt holds the tools, as the template renders them
    assert reply.usage.prompt_tokens > len(render_prompt(tokenizer, history))


@pytest.mark.parametrize("path,body,status,needle", [
    ("chat/completions", b"{not json", 400, "not valid JSON"),
    ("chat/completions", {"model": "gpt-4", "messages": ASK}, 404, "not served here"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": ASK, "n": 99}, 400, "n: must be in [1, 16]"),
    ("chat/completions", {"model": MODEL, "messages": ASK, "temperature": -1}, 400, "temperature"),
    ("chat/completions", {"model": MODEL, "messages": ASK, "max_tokens": 10_000}, 400, "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ("chat/completions", {"model": MODEL, "messages": ASK, "top_logprobs": 3}, 400, "top_logprobs"),
    ("completions", {"model": MODEL, "prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("completions", {"model": MODEL, "prompt": [5, 999]}, 400, "outside the vocabulary"),
    ("completions", {"model": MODEL, "prompt": "x", "presence_penalty": 1}, 400, "presence_penalty"),
    ("sessions/never-opened/reward", {"reward": 1.0}, 404, "not open"),
    ("sessions/never-opened/close", {}, 404, "not open"),
    ("no/such/route", {}, 404, "Not Found"),
])
async def test_a_bad_request_is_4xx_with_a_message(endpoint, path, body, status, needle):
    _, base_url, _ = endpoint
    async with httpx.AsyncClient(timeout=60) as http:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        reply = await http.post(f"{base_url}/{path}", content=content, headers={"content-type": "application/json"})
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert needle in error["message"] and error["type"], error
        assert (await http.get(f"{base_url}/models")).status_code == 200  # still serving


async def test_the_openai_client_raises_typed_errors(endpoint):
    _, base_url, _ = endpoint
    async with client(base_url) as api:
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await api.chat.completions.create(model=MODEL, messages=ASK, temperature=-2)
        with pytest.raises(openai.NotFoundError, match="not served here"):
            await api.completions.create(model="other", prompt="x")


async def test_a_session_is_token_exact_with_the_right_loss_mask(endpoint, api, tokenizer):
    _, base_url, _ = endpoint
    api = api.with_options(default_headers={"X-Session-Id": "agent-1"})
    first = await api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=1.0, seed=1,
                                              logprobs=True, extra_body={"ignore_eos": True})
    reply = first.choices[0]
    history = ASK + [{"role": "assistant", "content": reply.message.content},
                     {"role": "user", "content": "and 5*6?"}]
    with pytest.raises(openai.BadRequestError, match="diverged"):
        await api.chat.completions.create(model=MODEL, max_tokens=5, messages=[
            ASK[0], {"role": "assistant", "content": reply.message.content + "!"}, history[2]])
    second = await api.chat.completions.create(model=MODEL, messages=history, max_tokens=5, temperature=1.0,
                                               logprobs=True, extra_body={"ignore_eos": True})
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        assert (await http.post("/sessions/agent-1/reward", json={"reward": 1.0, "turn_reward": 0.5})).status_code == 200
        sample = (await http.post("/sessions/agent-1/close", json={})).json()
        gone = await http.post("/sessions/agent-1/close", json={})

    appended = render_continuation(tokenizer, history[2:], turn_closed=False)
    assert second.usage.prompt_tokens == len(appended)
    r1, r2 = reply.token_ids, second.choices[0].token_ids
    assert sample["prompt_ids"] == render_prompt(tokenizer, ASK)
    assert sample["response_ids"] == r1 + appended + r2
    assert sample["loss_mask"] == [1] * len(r1) + [0] * len(appended) + [1] * len(r2)
    policy = [lp for lp, m in zip(sample["logprobs"], sample["loss_mask"]) if m]
    returned = [t.logprob for t in reply.logprobs.content + second.choices[0].logprobs.content]
    np.testing.assert_allclose(policy, returned, atol=1e-6)
    assert sample["reward"] == 1.0 and sample["turn_rewards"] == [0.5] and sample["submitted"] is False
    assert sample["stats"]["turns"] == 2
    assert sample["stats"]["turn_prefill_tokens"][1] <= len(appended) + 1  # KV kept: only the new tokens
    assert gone.status_code == 404


async def test_a_closed_session_is_submitted_to_the_buffer(endpoint, api):
    _, base_url, buffer_address = endpoint
    api = api.with_options(default_headers={"X-Session-Id": "agent-submit"})
    await api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, temperature=1.0, seed=2)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        sample = (await http.post("/sessions/agent-submit/close", json={
            "reward": 0.25, "submit": True, "group_id": "g-1", "group_size": 1})).json()
    assert sample["submitted"] is True
    async with connect(buffer_address) as channel:
        stats = await buffer_pb2_grpc.BufferStub(channel).Stats(buffer_pb2.StatsRequest())
    assert stats.pending == 1


async def test_a_busy_session_is_409_and_too_many_sessions_429(endpoint):
    _, base_url, _ = endpoint
    for key in ("s1", "s2"):  # max_sessions is 3
        async with client(base_url, default_headers={"X-Session-Id": key}) as api:
            await api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    async with client(base_url, default_headers={"X-Session-Id": "long"}) as api, \
            httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        stream = await api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=480, stream=True,
                                                   extra_body={"ignore_eos": True})
        await anext(aiter(stream))
        with pytest.raises(openai.ConflictError, match="running a turn"):
            await api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
        full = await http.post("/chat/completions", headers={"X-Session-Id": "s4"},
                               json={"model": MODEL, "messages": ASK, "max_tokens": 1})
        assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
        assert "max_sessions" in full.json()["error"]["message"]
        for key in ("long", "s1", "s2"):
            assert (await http.post(f"/sessions/{key}/close", json={"reward": 0.0})).status_code == 200
        finishes = [c.choices[0].finish_reason async for c in stream if c.choices]
    assert finishes[-1] == "abort"  # closing the session ended the turn it was running


# ---- in process: what a running service cannot easily show


async def test_a_stopped_engine_is_503_and_the_api_key_can_name_the_session(tiny_model_dir):
    from rollout.config import EngineConfig
    from rollout.engine.async_engine import AsyncEngine
    from rollout.engine.llm_engine import LLMEngine
    from rollout.serve.openai_api import create_app
    from rollout.serve.openai_schema import OpenAISettings

    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=128)))
    app = create_app(engine, engine.engine.tokenizer, MODEL, OpenAISettings(session_by_key=True, retry_after_s=2))
    transport = httpx.ASGITransport(app=app)
    async with openai.AsyncOpenAI(base_url="http://app/v1", api_key="episode-9", max_retries=0,
                                  http_client=httpx.AsyncClient(transport=transport)) as api:
        await api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
        assert (await engine.session_state("episode-9")).num_tokens > 0  # the API key named the session
        engine.shutdown()
        with pytest.raises(openai.APIStatusError) as down:
            await api.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert down.value.status_code == 503 and down.value.response.headers["retry-after"] == "2"
    assert "engine" in down.value.message
