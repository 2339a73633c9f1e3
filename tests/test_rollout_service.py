"""The rollout service: a real server process on loopback with grpc.aio clients, plus the servicer
in-process (real server, real client) where a test needs to look inside the engine."""

import asyncio
import urllib.request

import grpc
import numpy as np
import pytest
import torch

from protos import rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_array, encode_array
from services.client import connect
from services.server import create_server

torch.set_num_threads(1)
VOCAB = 101  # the char tokenizer's vocabulary


async def read_rest(call) -> list[rollout_pb2.GenerateChunk]:
    """The remaining chunks of a stream already read with call.read() (the two styles cannot mix)."""
    chunks = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        chunks.append(chunk)
    return chunks


def make_request(prompt, request_id="", **params) -> rollout_pb2.GenerateRequest:
    params.setdefault("max_tokens", 8)
    params.setdefault("logprobs", True)
    return rollout_pb2.GenerateRequest(
        request_id=request_id, prompt_ids=encode_array(prompt, "int32"), params=rollout_pb2.SamplingParams(**params)
    )


@pytest.fixture(scope="module")
def rollout_process(tiny_model_dir, tmp_path_factory):
    from deploy.local.service_process import start_service

    service = start_service(
        "rollout",
        {"model": str(tiny_model_dir), "engine.max_model_len": 256, "engine.max_num_seqs": 64,
         "engine.torch_threads": 1, "server.metrics_port": 0},
        log_dir=tmp_path_factory.mktemp("rollout-logs"),
    )
    yield service
    service.stop(timeout=10)


def test_64_concurrent_streams_carry_logprobs_and_versions(rollout_process):
    async def one(stub, i: int):
        prompt = [3 + (i * 7 + j) % 90 for j in range(5 + i % 20)]
        chunks = [c async for c in stub.GenerateStream(make_request(prompt, f"s{i}", max_tokens=24, ignore_eos=True,
                                                                       temperature=1.0, seed=i), timeout=120)]
        tokens, logprobs, versions = [], [], []
        for chunk in chunks:
            t = decode_array(chunk.token_ids, expect="int32")
            lp = decode_array(chunk.logprobs, expect="float32")
            v = decode_array(chunk.weight_versions, expect="int64")
            assert len(t) == len(lp) == len(v) and chunk.request_id == f"s{i}"
            tokens += t.tolist()
            logprobs += lp.tolist()
            versions += v.tolist()
        assert [c.finish_reason for c in chunks[:-1]] == [rollout_pb2.FINISH_REASON_NONE] * (len(chunks) - 1)
        assert chunks[-1].finish_reason == rollout_pb2.FINISH_REASON_LENGTH
        return tokens, logprobs, versions

    async def main():
        async with connect(rollout_process.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            return await asyncio.gather(*(one(stub, i) for i in range(64)))

    results = asyncio.run(main())
    for tokens, logprobs, versions in results:
        assert len(tokens) == 24 and all(0 <= t < VOCAB for t in tokens)
        assert all(lp <= 0 and np.isfinite(lp) for lp in logprobs)
        assert versions == [0] * 24
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{rollout_process.metrics_port}/metrics", timeout=10).read()
    assert b"relayrl_rollout_generated_tokens_total 1536.0" in metrics
    assert b"relayrl_rollout_running_sequences 0.0" in metrics
    # Every prompt looked up once (5 + i % 20 tokens each); no two share a first block.
    assert f"relayrl_rollout_prefix_cache_queried_tokens {sum(5 + i % 20 for i in range(64))}.0".encode() in metrics
    assert b"relayrl_rollout_prefix_cache_hit_tokens 0.0" in metrics


@pytest.mark.parametrize("request_kwargs,field", [
    ({"prompt": [5, VOCAB]}, "prompt_ids"),
    ({"prompt": [5, -1]}, "prompt_ids"),
    ({"prompt": []}, "prompt_ids"),
    ({"prompt": [5], "max_tokens": 0}, "params.max_tokens"),
    ({"prompt": [5, 6], "max_tokens": 255}, "params.max_tokens"),
    ({"prompt": [5], "n": 17}, "params.n"),
    ({"prompt": [5], "temperature": -0.5}, "params.temperature"),
    ({"prompt": [5], "top_p": 0.0}, "params.top_p"),
    ({"prompt": [5], "top_k": -2}, "params.top_k"),
    ({"prompt": [5], "stop_token_ids": [VOCAB + 3]}, "params.stop_token_ids"),
])
def test_bad_requests_are_invalid_argument_naming_the_field(rollout_process, request_kwargs, field):
    async def main():
        async with connect(rollout_process.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await stub.Generate(make_request(**request_kwargs), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as stream:
                [c async for c in stub.GenerateStream(make_request(**request_kwargs), timeout=30)]
            still_serving = await stub.GetWeightVersion(rollout_pb2.GetWeightVersionRequest(), timeout=10)
            return unary.value, stream.value, still_serving

    unary, stream, still_serving = asyncio.run(main())
    for error in (unary, stream):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith(field), error.details()
    assert still_serving.version == 0


def test_unary_generate_text_prompt_model_info_abort_and_sessions(rollout_process):
    async def main():
        async with connect(rollout_process.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            reply = await stub.Generate(rollout_pb2.GenerateRequest(
                prompt_text="12+34=", params=rollout_pb2.SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=4,
                                                                         ignore_eos=True)), timeout=30)
            info = await stub.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=10)
            long_call = stub.GenerateStream(make_request([5, 6, 7], "to-abort", max_tokens=200, ignore_eos=True))
            first = await long_call.read()
            found = await stub.Abort(rollout_pb2.AbortRequest(request_id="to-abort"), timeout=10)
            rest = await read_rest(long_call)
            missing = await stub.Abort(rollout_pb2.AbortRequest(request_id="never-existed"), timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as empty_session:
                await stub.OpenSession(rollout_pb2.OpenSessionRequest(), timeout=10)
            return reply, info, first, found, rest, missing, empty_session.value

    reply, info, first, found, rest, missing, empty_session = asyncio.run(main())
    assert reply.prompt_tokens == 6 and len(reply.completions) == 3 and reply.request_id
    for completion in reply.completions:
        assert len(decode_array(completion.token_ids, expect="int32")) == 6
        assert completion.finish_reason == rollout_pb2.FINISH_REASON_LENGTH
        assert len(completion.text) > 0
    assert (info.vocab_size, info.max_model_len, info.eos_token_id, info.engine) == (VOCAB, 256, 2, "native")
    assert first.finish_reason == rollout_pb2.FINISH_REASON_NONE
    assert found.found and not missing.found
    assert rest[-1].finish_reason == rollout_pb2.FINISH_REASON_ABORT
    # Sessions are served (tests/test_sessions_service.py); one with no initial context is refused.
    assert empty_session.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_ids" in empty_session.details()


# ---- in-process server: the engine is reachable for inspection ----


async def _in_process(tiny_model_dir, **engine_settings):
    from rollout.config import EngineConfig
    from rollout.engine.async_engine import AsyncEngine
    from rollout.engine.llm_engine import LLMEngine
    from rollout.serve.service import RolloutServicer
    from rollout.serve.wire import SERVICE_NAME

    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), **engine_settings)))
    servicer = RolloutServicer(engine, str(tiny_model_dir), engine.engine.tokenizer)
    server, port = await create_server(
        "127.0.0.1:0", [(rollout_pb2_grpc.add_RolloutServicer_to_server, servicer, SERVICE_NAME)]
    )
    await server.start()
    return engine, server, f"127.0.0.1:{port}"


async def _wait_until(predicate, timeout_s: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_disconnected_stream_frees_its_blocks(tiny_model_dir):
    async def main():
        engine, server, address = await _in_process(tiny_model_dir, max_model_len=256, block_size=4)
        total = engine.stats["free_blocks"]
        async with connect(address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            calls = [stub.GenerateStream(make_request([5, 6, 7, 8, 9], f"gone{i}", max_tokens=240, ignore_eos=True,
                                                      n=2)) for i in range(3)]
            for call in calls:
                await call.read()
            assert engine.stats["free_blocks"] < total
            for call in calls:
                call.cancel()
            await _wait_until(lambda: engine.stats["free_blocks"] == total and not engine.engine.requests)
        await server.stop(None)
        engine.shutdown()

    asyncio.run(main())


def test_full_queue_is_resource_exhausted(tiny_model_dir):
    async def main():
        engine, server, address = await _in_process(tiny_model_dir, max_model_len=256, max_num_seqs=1, max_n=1,
                                                    max_queue=1)
        async with connect(address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            running = stub.GenerateStream(make_request([5, 6], "running", max_tokens=250, ignore_eos=True))
            await running.read()
            queued = stub.GenerateStream(make_request([5, 6], "queued", max_tokens=4))
            await _wait_until(lambda: engine.stats["waiting"] == 1)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(make_request([5, 6], "refused"), timeout=10)
            running.cancel()
            after = await read_rest(queued)
        await server.stop(None)
        engine.shutdown()
        return refused.value, after

    refused, after = asyncio.run(main())
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert after[-1].finish_reason == rollout_pb2.FINISH_REASON_LENGTH  # the queued request was served


def test_update_weights_between_steps_tags_later_tokens(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    from rollout.model.tiny import write_tiny_model

    other = load_file(write_tiny_model(tmp_path / "other", seed=5) / "model.safetensors")

    async def main():
        engine, server, address = await _in_process(tiny_model_dir, max_model_len=256)
        async with connect(address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            call = stub.GenerateStream(make_request([5, 6, 7], "live", max_tokens=200, ignore_eos=True))
            versions = decode_array((await call.read()).weight_versions, expect="int64").tolist()
            switch_s = await engine.update_weights(other, version=7)
            for chunk in await read_rest(call):
                versions += decode_array(chunk.weight_versions, expect="int64").tolist()
            reported = await stub.GetWeightVersion(rollout_pb2.GetWeightVersionRequest(), timeout=10)
        await server.stop(None)
        engine.shutdown()
        return versions, switch_s, reported.version

    versions, switch_s, reported = asyncio.run(main())
    assert len(versions) == 200 and versions[0] == 0 and versions[-1] == 7
    assert versions == sorted(versions) and set(versions) == {0, 7}  # one clean switch, never back
    assert 0 <= switch_s < 5 and reported == 7


def test_generate_many_answers_each_request_as_generate_would_and_refuses_as_a_whole(rollout_process):
    """GenerateMany: responses in request order, each the one Generate gives for the same request (same seed);
    a bad request is INVALID_ARGUMENT naming its index, and the good requests of that call are aborted."""
    prompts = [[1, 20, 21], [1, 30, 31, 32, 33], [1, 40]]

    def requests(tag: str) -> list[rollout_pb2.GenerateRequest]:
        return [make_request(p, f"{tag}{i}", n=3, temperature=1.0, seed=100 + i, max_tokens=6)
                for i, p in enumerate(prompts)]

    async def main():
        async with connect(rollout_process.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            many = await stub.GenerateMany(rollout_pb2.GenerateManyRequest(requests=requests("m")), timeout=30)
            single = [await stub.Generate(r, timeout=30) for r in requests("g")]
            errors = []
            for bad in ([make_request([1, 20], "long", max_tokens=240, ignore_eos=True),
                         make_request([5], "bad", max_tokens=0)],
                        [make_request([5], "same"), make_request([6], "same")],
                        []):
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.GenerateMany(rollout_pb2.GenerateManyRequest(requests=bad), timeout=30)
                errors.append(error.value)
            # 240 tokens take far longer than this call: the id is free again only if the refusal aborted it.
            reused = await stub.Generate(make_request([1, 20], "long", max_tokens=2), timeout=30)
            return many, single, errors, reused

    many, single, errors, reused = asyncio.run(main())
    assert [r.request_id for r in many.responses] == ["m0", "m1", "m2"]
    for got, want in zip(many.responses, single, strict=True):
        assert got.prompt_tokens == want.prompt_tokens
        assert [decode_array(c.token_ids, expect="int32").tolist() for c in got.completions] == \
            [decode_array(c.token_ids, expect="int32").tolist() for c in want.completions]
        for a, b in zip(got.completions, want.completions, strict=True):
            np.testing.assert_allclose(decode_array(a.logprobs, expect="float32"),
                                       decode_array(b.logprobs, expect="float32"), atol=1e-6)
    assert [e.code() for e in errors] == [grpc.StatusCode.INVALID_ARGUMENT] * 3
    assert errors[0].details().startswith("requests[1].params.max_tokens"), errors[0].details()
    assert "distinct" in errors[1].details() and "at least one" in errors[2].details()
    assert reused.request_id == "long"


def test_compute_logprobs_scores_generated_tokens_and_refuses_bad_ids(rollout_process):
    """A teacher's view: the logprobs ComputeLogprobs gives for sampled tokens at the sampling temperature
    are the ones Generate reported for them (same weights; Generate says which temperature they are at);
    a bad id is INVALID_ARGUMENT naming the response."""
    async def main():
        async with connect(rollout_process.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            prompt = [1, 20, 21, 22]
            generated = await stub.Generate(make_request(prompt, n=4, temperature=0.7, seed=9, ignore_eos=True,
                                                         max_tokens=12), timeout=30)
            responses = [c.token_ids for c in generated.completions]
            scored = await stub.ComputeLogprobs(rollout_pb2.ComputeLogprobsRequest(
                prompt_ids=encode_array(prompt, "int32"), response_ids=responses, temperature=0.7), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.ComputeLogprobs(rollout_pb2.ComputeLogprobsRequest(
                    prompt_ids=encode_array(prompt, "int32"),
                    response_ids=[encode_array([3], "int32"), encode_array([VOCAB], "int32")]), timeout=30)
            still_serving = await stub.GetWeightVersion(rollout_pb2.GetWeightVersionRequest(), timeout=10)
            return generated, scored, bad.value, still_serving

    generated, scored, bad, still_serving = asyncio.run(main())
    assert len(scored.logprobs) == 4 and scored.weight_version == 0
    assert [c.logprobs_temperature for c in generated.completions] == [pytest.approx(0.7)] * 4
    for completion, logprobs in zip(generated.completions, scored.logprobs):
        np.testing.assert_allclose(decode_array(logprobs, expect="float32"),
                                   decode_array(completion.logprobs, expect="float32"), atol=1e-5)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert bad.details().startswith("response_ids[1]: token id 101"), bad.details()
    assert still_serving.version == 0


def test_a_version_watch_answers_when_new_weights_land_and_refuses_bad_waits(tiny_model_dir, tmp_path):
    """GetWeightVersion(newer_than, wait_s): answers the moment a newer version is served (what ends a producer's
    admission pause), after wait_s with the version then, at once for any other newer_than (older: new weights
    already; newer: the caller knew a process before a restart); bad waits refused."""
    import time

    from safetensors.torch import load_file

    from rollout.model.tiny import write_tiny_model

    other = load_file(write_tiny_model(tmp_path / "other", seed=5) / "model.safetensors")

    async def main():
        engine, server, address = await _in_process(tiny_model_dir, max_model_len=256)
        async with connect(address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)

            async def watch(newer_than: int, wait_s: float) -> tuple[int, float]:
                started = time.monotonic()
                reply = await stub.GetWeightVersion(
                    rollout_pb2.GetWeightVersionRequest(newer_than=newer_than, wait_s=wait_s), timeout=30)
                return reply.version, time.monotonic() - started

            timed_out = await watch(0, 0.3)
            watching = asyncio.ensure_future(watch(0, 20.0))
            await asyncio.sleep(0.3)
            assert not watching.done()
            update_started = time.monotonic()
            await engine.update_weights(other, version=3)
            landed = await watching
            landed_after_update_s = time.monotonic() - update_started
            already_newer = await watch(2, 20.0)
            behind = await watch(9, 20.0)  # a caller that knew a later version (of a process before a restart)
            codes = []
            for wait_s in (-1.0, 61.0, float("nan")):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await watch(0, wait_s)
                codes.append((refused.value.code(), refused.value.details()))
            still_serving = await watch(0, 0.0)
        await server.stop(None)
        engine.shutdown()
        return timed_out, landed, landed_after_update_s, already_newer, behind, codes, still_serving

    timed_out, landed, landed_after_update_s, already_newer, behind, codes, still_serving = asyncio.run(main())
    assert timed_out[0] == 0 and 0.25 <= timed_out[1] < 5
    assert landed[0] == 3 and landed[1] >= 0.3 and landed_after_update_s < 1.0
    assert already_newer[0] == 3 and already_newer[1] < 1.0
    assert behind[0] == 3 and behind[1] < 1.0
    assert all(code == grpc.StatusCode.INVALID_ARGUMENT and "wait_s" in details for code, details in codes), codes
    assert still_serving[0] == 3
