"""Prefill/decode disaggregation with real processes on loopback: a prefill worker, decode workers, the rollout
router in front, and a monolithic rollout worker to compare with (rollout/pd/prefill.py, pd_decode.py, router.py)."""

import asyncio
import time
import urllib.request

import grpc
import pytest

from protos import kv_pb2, kv_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_array, encode_array
from services.client import connect

ENGINE = {"engine.max_model_len": 256, "engine.torch_threads": 1}
# a mixed batch: prompt lengths 1..61, greedy and sampled, n = 1..4
REQUESTS = [(length, {"temperature": t, "n": n, "seed": seed, "max_tokens": m, "ignore_eos": True})
            for length, t, n, seed, m in [(5, 0, 1, None, 12), (16, 1.0, 3, 11, 10), (33, 0, 2, None, 9),
                                          (17, 0.8, 1, 5, 14), (61, 1.0, 4, 99, 7), (1, 0, 1, None, 6)]]


def prompt_of(i: int, length: int) -> list[int]:
    return [3 + (i * 7 + j) % 90 for j in range(length)]


def request_of(i: int, length: int, params: dict, request_id: str | None = None) -> rollout_pb2.GenerateRequest:
    params = {k: v for k, v in params.items() if v is not None}
    return rollout_pb2.GenerateRequest(request_id=request_id or f"r{i}", prompt_ids=encode_array(prompt_of(i, length),
                                       "int32"), params=rollout_pb2.SamplingParams(logprobs=True, **params))


def tokens_and_logprobs(response: rollout_pb2.GenerateResponse) -> list[tuple[list[int], list[float]]]:
    return [(decode_array(c.token_ids).tolist(), decode_array(c.logprobs).tolist()) for c in response.completions]


@pytest.fixture(scope="module")
def cluster(sharp_model_dir, tmp_path_factory):
    from deploy.local.service_process import start_service

    logs = tmp_path_factory.mktemp("pd-logs")
    model = {"model": str(sharp_model_dir), **ENGINE}
    started = {"mono": start_service("rollout", model, log_dir=logs),
               "prefill": start_service("prefill", model, log_dir=logs)}
    started["decode"] = start_service("decode", {**model, "prefill": [started["prefill"].address]}, log_dir=logs)
    started["router"] = start_service("rollout", {**model, "router.decode": [started["decode"].address],
                                                  "server.metrics_port": 0}, log_dir=logs)
    yield started
    for service in started.values():
        service.stop(timeout=10)


async def generate_all(address: str, requests) -> list[rollout_pb2.GenerateResponse]:
    async with connect(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        return await asyncio.gather(*(stub.Generate(request, timeout=120) for request in requests))


def test_split_equals_monolithic_over_a_mixed_batch(cluster):
    seeded = [request_of(i, length, {**params, "seed": params["seed"] or 1000 + i})
              for i, (length, params) in enumerate(REQUESTS)]
    mono = asyncio.run(generate_all(cluster["mono"].address, seeded))
    split = asyncio.run(generate_all(cluster["router"].address, seeded))
    for request, a, b in zip(seeded, mono, split):
        assert len(b.completions) == (request.params.n or 1)
        for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(tokens_and_logprobs(a), tokens_and_logprobs(b)):
            assert tokens_a == tokens_b and len(tokens_a) == request.params.max_tokens
            assert max(abs(x - y) for x, y in zip(logprobs_a, logprobs_b)) < 1e-5
        # how old the KV each completion was sampled on: the decode worker's answer said nothing of it
        assert all(c.HasField("kv_version") for c in b.completions)
        assert [c.kv_version for c in b.completions] == [c.kv_version for c in a.completions] == [0] * len(a.completions)

    async def stream():  # GenerateStream through the router: the same tokens, the first ones included
        async with connect(cluster["router"].address) as channel:
            chunks = [c async for c in rollout_pb2_grpc.RolloutStub(channel).GenerateStream(seeded[1], timeout=60)]
        by_index: dict[int, list[int]] = {}
        for chunk in chunks:
            by_index.setdefault(chunk.index, []).extend(decode_array(chunk.token_ids).tolist())
        last = {chunk.index: chunk for chunk in chunks}
        assert all(chunk.HasField("kv_version") and chunk.kv_version == 0 for chunk in last.values())
        return [by_index[i] for i in sorted(by_index)]

    assert asyncio.run(stream()) == [tokens for tokens, _ in tokens_and_logprobs(mono[1])]


async def prefill(address: str, request, codec: str) -> list[kv_pb2.KVTransferChunk]:
    async with connect(address) as channel:
        stub = kv_pb2_grpc.PrefillWorkerStub(channel)
        return [c async for c in stub.Prefill(kv_pb2.PrefillRequest(request=request, codec=codec), timeout=60)]


async def continue_(address: str, chunks) -> list[rollout_pb2.GenerateChunk]:
    async with connect(address) as channel:
        stub = kv_pb2_grpc.DecodeWorkerStub(channel)
        return [c async for c in stub.Continue(iter(chunks), timeout=60)]


def test_int8_on_the_wire_moves_3_5x_fewer_bytes_and_keeps_greedy_tokens(cluster):
    requests = [request_of(i, 40 + 6 * i, {"temperature": 0, "max_tokens": 24, "ignore_eos": True}) for i in range(8)]
    mono = asyncio.run(generate_all(cluster["mono"].address, requests))
    moved = {"none": 0, "int8": 0}
    agree = total = 0
    for request, reference in zip(requests, mono):
        for codec in moved:
            chunks = asyncio.run(prefill(cluster["prefill"].address, request, codec))
            assert chunks[0].header.codec == codec
            moved[codec] += sum(len(c.payload) for c in chunks[1:])
        tokens = [t for c in asyncio.run(continue_(cluster["decode"].address, chunks))
                  for t in decode_array(c.token_ids).tolist()]
        expected = tokens_and_logprobs(reference)[0][0]
        agree += sum(a == b for a, b in zip(tokens, expected))
        total += len(expected)
        assert len(tokens) == len(expected)
    assert moved["none"] / moved["int8"] >= 3.5
    assert agree / total >= 0.99


def mutated(chunks, change):
    header = kv_pb2.KVTransferHeader()
    header.CopyFrom(chunks[0].header)
    payload = [c.payload for c in chunks[1:]]
    change(header, payload)
    return [kv_pb2.KVTransferChunk(header=header), *(kv_pb2.KVTransferChunk(payload=p) for p in payload)]


def flip_byte(header, payload):
    payload[0] = bytes([payload[0][0] ^ 1]) + payload[0][1:]


@pytest.mark.parametrize("change, code, words", [
    (lambda h, p: setattr(h.layout, "num_kv_heads", 4), grpc.StatusCode.INVALID_ARGUMENT, "layout"),
    (lambda h, p: setattr(h.layout, "num_tokens", 12), grpc.StatusCode.INVALID_ARGUMENT, "num_tokens"),
    (lambda h, p: setattr(h.layout, "dtype", "bfloat16"), grpc.StatusCode.INVALID_ARGUMENT, "dtype"),
    (lambda h, p: setattr(h, "weight_version", 7), grpc.StatusCode.FAILED_PRECONDITION, "version 7"),
    (flip_byte, grpc.StatusCode.DATA_LOSS, "CRC-32"),
    (lambda h, p: p.pop(), grpc.StatusCode.DATA_LOSS, "announced"),
])
def test_bad_transfers_are_refused_and_the_decode_worker_keeps_serving(cluster, change, code, words):
    request = request_of(0, 40, {"temperature": 0, "max_tokens": 8}, request_id="bad")
    chunks = asyncio.run(prefill(cluster["prefill"].address, request, "none"))
    assert len(chunks) > 1
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(continue_(cluster["decode"].address, mutated(chunks, change)))
    assert refused.value.code() == code and words in refused.value.details()
    good = asyncio.run(continue_(cluster["decode"].address, chunks))
    assert sum(c.token_ids.length for c in good) == 8 and good[-1].finish_reason == rollout_pb2.FINISH_REASON_LENGTH
    assert cluster["decode"].alive()


def live_workers(router) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{router.metrics_port}/metrics", timeout=10).read().decode()
    line = next(line for line in text.splitlines() if line.startswith("relayrl_router_live_decode_workers "))
    return float(line.split()[1])


def test_a_killed_decode_worker_has_its_requests_rerun_elsewhere(cluster, tmp_path):
    from deploy.local.service_process import start_service

    model = {"model": cluster["mono"].overrides["model"], **ENGINE}
    decoders = [start_service("decode", {**model, "prefill": [cluster["prefill"].address]}, log_dir=tmp_path)
                for _ in range(2)]
    router = start_service("rollout", {**model, "router.decode": [d.address for d in decoders], "router.poll_s": 0.5,
                                       "server.metrics_port": 0}, log_dir=tmp_path)
    try:
        requests = [request_of(i, 10 + i, {"temperature": 1.0, "max_tokens": 200, "ignore_eos": True, "seed": i},
                               request_id=f"k{i}") for i in range(8)]
        mono = asyncio.run(generate_all(cluster["mono"].address, requests))

        async def run():
            async with connect(router.address) as channel:
                stub = rollout_pb2_grpc.RolloutStub(channel)
                calls = [asyncio.ensure_future(stub.Generate(r, timeout=120)) for r in requests]
                async with connect(decoders[0].address) as victim:
                    load = kv_pb2_grpc.DecodeWorkerStub(victim)
                    while (await load.GetLoad(kv_pb2.GetLoadRequest())).running == 0:
                        await asyncio.sleep(0.01)
                decoders[0].kill()  # mid-generation: it holds running sequences
                killed_at = time.monotonic()
                return await asyncio.gather(*calls), killed_at

        responses, killed_at = asyncio.run(run())
        for a, b in zip(mono, responses):
            assert tokens_and_logprobs(a)[0][0] == tokens_and_logprobs(b)[0][0]  # complete, and the same tokens
        while live_workers(router) != 1:
            assert time.monotonic() - killed_at < 5, "the router still routes to the dead worker"
            time.sleep(0.1)
        again = asyncio.run(generate_all(router.address, requests[:2]))
        assert all(len(tokens_and_logprobs(r)[0][0]) == 200 for r in again)
    finally:
        router.stop(timeout=10)
        for decoder in decoders:
            decoder.stop(timeout=10)


def test_a_trainer_publish_reaches_prefill_and_decode_workers_and_the_split_follows_it(sharp_model_dir, tmp_path):
    """The trainer's broadcaster publishes new weights to a prefill worker, a decode worker and a monolithic worker
    at once; afterwards the split serves the new version and equals the monolithic worker again."""
    import torch
    from transformers import AutoModelForCausalLM

    from deploy.local.service_process import start_service
    from trainer.broadcast.broadcaster import WeightBroadcaster
    from trainer.broadcast.config import BroadcastConfig

    model = {"model": str(sharp_model_dir), **ENGINE}
    mono = start_service("rollout", model, log_dir=tmp_path)
    prefill_worker = start_service("prefill", model, log_dir=tmp_path)
    decoder = start_service("decode", {**model, "prefill": [prefill_worker.address]}, log_dir=tmp_path)
    router = start_service("rollout", {**model, "router.decode": [decoder.address]}, log_dir=tmp_path)
    try:
        requests = [request_of(i, length, {**params, "seed": params["seed"] or 1000 + i})
                    for i, (length, params) in enumerate(REQUESTS)]
        before = asyncio.run(generate_all(router.address, requests))
        trainer_model = AutoModelForCausalLM.from_pretrained(sharp_model_dir, dtype=torch.float32)
        gen = torch.Generator().manual_seed(5)
        weights = {name: t + torch.randn(t.shape, generator=gen) * 0.05 for name, t in trainer_model.state_dict().items()}

        async def publish():
            addresses = [mono.address, prefill_worker.address, decoder.address]
            async with WeightBroadcaster(addresses, BroadcastConfig(timeout_s=60)) as broadcaster:
                return await broadcaster.publish(weights, 1)

        asyncio.run(publish())
        mono_after = asyncio.run(generate_all(mono.address, requests))
        split_after = asyncio.run(generate_all(router.address, requests))
        changed = 0
        for old, a, b in zip(before, mono_after, split_after):
            for (tokens_old, logprobs_old), (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(
                    tokens_and_logprobs(old), tokens_and_logprobs(a), tokens_and_logprobs(b)):
                assert tokens_a == tokens_b
                assert max(abs(x - y) for x, y in zip(logprobs_a, logprobs_b)) < 1e-5
                changed += max(abs(x - y) for x, y in zip(logprobs_a, logprobs_old)) > 1e-3
            assert {int(v) for c in b.completions for v in decode_array(c.weight_versions)} == {1}
            assert [c.kv_version for c in b.completions] == [1] * len(b.completions)
        assert changed >= 5  # the new weights are served, not the old ones
    finally:
        for service in (router, decoder, prefill_worker, mono):
            service.stop(timeout=10)


def test_sessions_stay_on_the_decode_worker_that_opened_them(sharp_model_dir, tmp_path):
    """Sessions opened through the router spread over two decode workers by load, and every later call of a
    session reaches the worker holding its KV: the episodes equal the monolithic worker's, token for token."""
    from deploy.local.service_process import start_service

    model = {"model": str(sharp_model_dir), **ENGINE}
    mono = start_service("rollout", model, log_dir=tmp_path)
    prefill_worker = start_service("prefill", model, log_dir=tmp_path)
    decoders = [start_service("decode", {**model, "prefill": [prefill_worker.address]}, log_dir=tmp_path)
                for _ in range(2)]
    router = start_service("rollout", {**model, "router.decode": [d.address for d in decoders], "router.poll_s": 0.1},
                           log_dir=tmp_path)
    greedy = rollout_pb2.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True)

    async def episodes(address: str, pause_s: float) -> list[list[int]]:
        async with connect(address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            ids = []
            for i in range(4):  # each opened after the last one's first turn took blocks (and a load poll saw it)
                opened = await stub.OpenSession(rollout_pb2.OpenSessionRequest(prompt_ids=encode_array(
                    prompt_of(i, 20 + i), "int32")), timeout=30)
                ids.append(opened.session_id)
                [turn async for turn in stub.GenerateInSession(rollout_pb2.GenerateInSessionRequest(
                    session_id=opened.session_id, params=greedy, whole_turn=True), timeout=30)]
                await asyncio.sleep(pause_s)
            for turn in range(2):
                for i, session_id in enumerate(ids):
                    await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
                        session_id=session_id, token_ids=encode_array(prompt_of(turn, 3 + i), "int32")), timeout=30)
                    [c async for c in stub.GenerateInSession(rollout_pb2.GenerateInSessionRequest(
                        session_id=session_id, params=greedy), timeout=30)]
            holders = []
            for session_id in ids:  # which worker holds each session: a reward-only append succeeds there alone
                found = []
                for decoder in decoders:
                    async with connect(decoder.address) as direct:
                        try:
                            await rollout_pb2_grpc.RolloutStub(direct).AppendToSession(
                                rollout_pb2.AppendToSessionRequest(session_id=session_id, turn_reward=0.0), timeout=30)
                            found.append(decoder.address)
                        except grpc.aio.AioRpcError as exc:
                            assert exc.code() == grpc.StatusCode.NOT_FOUND
                holders.append(found)
            closed = [await stub.CloseSession(rollout_pb2.CloseSessionRequest(session_id=s), timeout=30) for s in ids]
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(session_id=ids[0], turn_reward=1.0))
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
            return [decode_array(c.sample.response_ids).tolist() for c in closed], holders

    try:
        split, holders = asyncio.run(episodes(router.address, pause_s=0.4))
        assert all(len(found) == 1 for found in holders)
        assert {found[0] for found in holders} == {d.address for d in decoders}  # spread over both by load
        reference, _ = asyncio.run(episodes(mono.address, pause_s=0))
        assert split == reference and all(len(tokens) == 6 + (3 + i) + 6 + (3 + i) + 6 for i, tokens in
                                          enumerate(split))
    finally:
        for service in (router, *decoders, prefill_worker, mono):
            service.stop(timeout=10)
