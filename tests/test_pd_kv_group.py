"""The KV channel over torch.distributed (rollout/kv_group.py), with real processes on loopback: a prefill worker
and a decode worker in one gloo group move payloads by send/recv, only headers over gRPC, and generate exactly
what a monolithic worker generates."""

import asyncio
import time
import urllib.request

from protos import kv_pb2, kv_pb2_grpc
from services.client import connect
from tests.test_pd_disagg import ENGINE, REQUESTS, generate_all, request_of, tokens_and_logprobs


def metric(service, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def wait_joined(service, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while "joined" not in service.log_tail(200):
        assert time.monotonic() < deadline, f"{service.name} never joined the KV group:\n{service.log_tail()}"
        time.sleep(0.2)


def test_payloads_go_over_the_group_and_the_split_still_equals_monolithic(sharp_model_dir, tmp_path, free_port):
    from deploy.launcher import start_service

    model = {"model": str(sharp_model_dir), **ENGINE}
    group = {"master": f"127.0.0.1:{free_port}", "world_size": 2}
    started = [start_service("rollout", model, log_dir=tmp_path)]
    try:
        prefill = start_service("prefill", {**model, "kv_group": {**group, "rank": 0}}, log_dir=tmp_path)
        started.append(prefill)
        decode = start_service("decode", {**model, "prefill": [prefill.address], "kv_group": {**group, "rank": 1},
                                          "server.metrics_port": 0}, log_dir=tmp_path)
        started.append(decode)
        wait_joined(prefill)
        wait_joined(decode)
        requests = [request_of(i, length, params) for i, (length, params) in enumerate(REQUESTS)]
        mono = asyncio.run(generate_all(started[0].address, requests))
        split = asyncio.run(generate_all(decode.address, requests))
        for reference, got in zip(mono, split):
            for (tokens, logprobs), (want_tokens, want_logprobs) in zip(tokens_and_logprobs(got),
                                                                        tokens_and_logprobs(reference)):
                assert tokens == want_tokens
                assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 1e-5
        grouped = metric(decode, "relayrl_decode_kv_group_bytes_total")
        assert grouped > 0 and grouped == metric(decode, "relayrl_decode_kv_transfer_bytes_total")

        # Over gRPC the same prefill worker still streams the payload to a caller outside the group.
        async def header_only_when_asked():
            async with connect(prefill.address) as channel:
                stub = kv_pb2_grpc.PrefillWorkerStub(channel)
                plain = [c async for c in stub.Prefill(kv_pb2.PrefillRequest(request=requests[0]), timeout=60)]
                return plain
        plain = asyncio.run(header_only_when_asked())
        assert not plain[0].header.HasField("payload_from_rank")
        assert sum(len(c.payload) for c in plain[1:]) == plain[0].header.payload_bytes > 0
    finally:
        for service in started:
            service.stop(timeout=10)
