"""Session RPCs on a real rollout process (and a real buffer process for submission), grpc.aio clients:
chat messages in, tokens out exactly, KV kept between turns, the episode submitted to the buffer, and every
refusal a clear status while other sessions go on."""

import asyncio

import grpc
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from protos import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_array, encode_array
from protos.sample import Sample
from services.client import connect
from trainer.batch import collate
from trainer.model import load_policy, run_policy

torch.set_num_threads(1)
SYSTEM = [rollout_pb2.ChatMessage(role="user", content="guess my number")]


@pytest.fixture(scope="module")
def services(tiny_model_dir, tmp_path_factory):
    from deploy.local.service_process import start_service

    logs = tmp_path_factory.mktemp("session-logs")
    buffer = start_service("buffer", {"data_dir": str(tmp_path_factory.mktemp("buffer")), "max_staleness": 4},
                           log_dir=logs)
    # Without the prefix cache: these tests count each session's own prefill, and their sessions share SYSTEM
    # (sessions sharing cached blocks: tests/test_engine_prefix_cache.py).
    rollout = start_service("rollout", {
        "model": str(tiny_model_dir), "engine.max_model_len": 256, "engine.torch_threads": 1,
        "engine.session_idle_timeout_s": 2.0, "engine.max_sessions": 8, "engine.enable_prefix_caching": False,
        "buffer": buffer.address}, log_dir=logs)
    yield rollout, buffer
    rollout.stop(timeout=10)
    buffer.stop(timeout=10)


async def generate(stub, session_id: str, whole_turn: bool = False, chunks: list | None = None, **params
                   ) -> tuple[list[int], list[float], list[int], int]:
    params.setdefault("max_tokens", 6)
    params.setdefault("temperature", 0.7)
    tokens, logprobs, versions, reason = [], [], [], 0
    async for chunk in stub.GenerateInSession(rollout_pb2.GenerateInSessionRequest(
            session_id=session_id, params=rollout_pb2.SamplingParams(logprobs=True, **params), whole_turn=whole_turn)):
        tokens += decode_array(chunk.token_ids).tolist()
        logprobs += decode_array(chunk.logprobs).tolist()
        versions += decode_array(chunk.weight_versions).tolist()
        reason = chunk.finish_reason
        if chunks is not None:
            chunks.append(chunk)
    return tokens, logprobs, versions, reason


async def test_a_whole_turn_comes_in_one_chunk_equal_to_the_streamed_turn(services):
    rollout, _ = services
    async with connect(rollout.address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        turns = {}
        for whole in (False, True):
            session_id = f"whole-{whole}"
            await stub.OpenSession(rollout_pb2.OpenSessionRequest(session_id=session_id, messages=SYSTEM))
            chunks = []
            turns[whole] = await generate(stub, session_id, whole_turn=whole, chunks=chunks, seed=11, max_tokens=12)
            assert (len(chunks) == 1) == whole and len(chunks) >= 1
            closed = await stub.CloseSession(rollout_pb2.CloseSessionRequest(session_id=session_id))
            assert Sample.from_proto(closed.sample).response_ids.tolist() == turns[whole][0]
            text = "".join(chunk.text for chunk in chunks)
            assert text == closed.sample.response_text
        assert turns[True] == turns[False] and len(turns[True][0]) > 1
        # A refusal is the same status as when streaming.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await generate(stub, "nope", whole_turn=True)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_a_chat_episode_is_token_exact_keeps_kv_and_lands_in_the_buffer(services, tiny_model_dir):
    rollout, buffer = services
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    async with connect(rollout.address) as channel, connect(buffer.address) as buffer_channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        opened = await stub.OpenSession(rollout_pb2.OpenSessionRequest(session_id="ep-1", messages=SYSTEM))
        prompt = decode_array(opened.token_ids).tolist()
        assert prompt == tokenizer.apply_chat_template([{"role": "user", "content": "guess my number"}],
                                                       add_generation_prompt=True)["input_ids"]
        context, mask, policy_logprobs = list(prompt), [], []
        for turn in range(3):
            tokens, logprobs, versions, _ = await generate(stub, "ep-1", seed=turn)
            assert len(tokens) == len(logprobs) == len(versions) > 0
            context += tokens
            mask += [1] * len(tokens)
            policy_logprobs += logprobs
            appended = await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
                session_id="ep-1", messages=[rollout_pb2.ChatMessage(role="user", content="higher")],
                turn_reward=0.5))
            new = decode_array(appended.token_ids).tolist()
            assert tokenizer.decode(new).endswith("<bos>user\nhigher<eos>\n<bos>assistant\n")
            context += new
            mask += [0] * len(new)
            assert appended.num_tokens == len(context)
        closed = await stub.CloseSession(rollout_pb2.CloseSessionRequest(
            session_id="ep-1", reward=1.0, submit=True, group_id="task-7", group_size=1, prompt_id="task-7"))
        assert closed.submitted
        sample = Sample.from_proto(closed.sample)
        assert sample.prompt_ids.tolist() + sample.response_ids.tolist() == context
        assert sample.loss_mask.tolist() == mask
        assert np.allclose(sample.rollout_logprobs[sample.loss_mask == 1], policy_logprobs)
        assert (sample.rollout_logprobs[sample.loss_mask == 0] == 0).all()
        assert sample.turn_rewards.tolist() == [0.5, 0.5, 0.5] and sample.temperature == pytest.approx(0.7)
        assert closed.stats.turns == 3 and closed.stats.kv_recomputes == 0
        # Turn k prefills only its new tokens: the last token of turn k-1 (sampled, never fed) + the observation.
        assert closed.stats.turn_prefill_tokens[0] == len(prompt)
        assert all(n < 30 for n in closed.stats.turn_prefill_tokens[1:])
        assert sum(closed.stats.turn_prefill_tokens) == closed.stats.prefill_tokens
        stats = await buffer_pb2_grpc.BufferStub(buffer_channel).Stats(buffer_pb2.StatsRequest())
        assert stats.pending == 1
    # The trainer's forward pass over the episode gives the logprobs the session reported (float32).
    batch = collate([sample])
    with torch.no_grad():
        trained = run_policy(load_policy(tiny_model_dir), batch.input_ids, batch.attention_mask, batch.temperatures)
    policy = batch.loss_mask.bool()
    assert torch.allclose(trained.logprobs[policy], batch.rollout_logprobs[policy], atol=1e-4)


async def test_refusals_are_clear_statuses_and_other_sessions_go_on(services):
    rollout, _ = services
    async with connect(rollout.address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        await stub.OpenSession(rollout_pb2.OpenSessionRequest(session_id="bystander", prompt_text="hi", add_bos=True))
        await stub.OpenSession(rollout_pb2.OpenSessionRequest(session_id="victim", prompt_text="hello"))

        async def code_of(call) -> grpc.StatusCode:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            assert info.value.details()
            return info.value.code()

        assert await code_of(stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
            session_id="nope", text="x"))) == grpc.StatusCode.NOT_FOUND
        assert await code_of(generate(stub, "nope")) == grpc.StatusCode.NOT_FOUND
        assert await code_of(stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
            session_id="victim", text="x" * 300))) == grpc.StatusCode.OUT_OF_RANGE
        assert await code_of(stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
            session_id="victim", text="x", token_ids=encode_array([5], "int32")))) == grpc.StatusCode.INVALID_ARGUMENT
        assert await code_of(stub.OpenSession(rollout_pb2.OpenSessionRequest(
            session_id="victim", prompt_text="again"))) == grpc.StatusCode.ALREADY_EXISTS
        # A second concurrent turn on one session.
        long_turn = stub.GenerateInSession(rollout_pb2.GenerateInSessionRequest(
            session_id="victim", params=rollout_pb2.SamplingParams(max_tokens=200, ignore_eos=True)))
        first = await long_turn.read()  # the turn is running now
        assert await code_of(generate(stub, "victim")) == grpc.StatusCode.FAILED_PRECONDITION
        assert await code_of(stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
            session_id="victim", text="x"))) == grpc.StatusCode.FAILED_PRECONDITION
        chunks = [first]
        while (chunk := await long_turn.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
        assert sum(chunk.token_ids.length for chunk in chunks) == 200
        # Submitting with no buffer is refused on a server without one (this one has it); a bad metadata blob is
        # INVALID_ARGUMENT before anything closes.
        assert await code_of(stub.CloseSession(rollout_pb2.CloseSessionRequest(
            session_id="victim", metadata=b"\xc1"))) == grpc.StatusCode.INVALID_ARGUMENT
        # The bystander was not affected by any of it.
        tokens, *_ = await generate(stub, "bystander", temperature=0.0)
        assert tokens
        closed = await stub.CloseSession(rollout_pb2.CloseSessionRequest(session_id="bystander"))
        assert closed.sample.prompt_text == "hi" and not closed.submitted
        await stub.CloseSession(rollout_pb2.CloseSessionRequest(session_id="victim"))
        assert await code_of(stub.CloseSession(rollout_pb2.CloseSessionRequest(
            session_id="victim"))) == grpc.StatusCode.NOT_FOUND


async def test_idle_sessions_expire_and_say_so(services):
    rollout, _ = services
    async with connect(rollout.address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        await stub.OpenSession(rollout_pb2.OpenSessionRequest(session_id="sleepy", prompt_text="zz"))
        await asyncio.sleep(3.5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(session_id="sleepy", text="wake"))
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "expired" in info.value.details()
