"""The KV channel over torch.distributed (rollout/pd/kv_group.py), with real processes on loopback: a prefill worker
and a decode worker in one gloo group move payloads by send/recv, only headers over gRPC, and generate exactly
what a monolithic worker generates. The `gpu` tests do the same over an NCCL group between two GPUs, and show
two workers on one GPU refused by the group (by name, in their logs) while transfers go on over gRPC."""

import asyncio
import contextlib
import threading
import time
import urllib.request

import pytest
import torch

from protos import kv_pb2, kv_pb2_grpc
from rollout.pd.kv_group import KVGroup, KVGroupConfig
from services.client import connect
from tests.test_pd_disagg import ENGINE, REQUESTS, generate_all, request_of, tokens_and_logprobs


def metric(service, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def wait_joined(service, phrase: str = "joined", timeout: float = 60.0) -> None:
    """Until the worker's log says `phrase` about the KV group ("joined", or "could not join")."""
    deadline = time.monotonic() + timeout
    while phrase not in service.log_tail(200):
        assert time.monotonic() < deadline, f"{service.name} never logged {phrase!r}:\n{service.log_tail()}"
        time.sleep(0.2)


@contextlib.contextmanager
def split_equal_to_monolithic(model_dir, tmp_path, port, backend="gloo", devices=("cpu", "cpu", "cpu"), atol=1e-5,
                              grouped=True):
    """A monolithic rollout worker, a prefill worker (rank 0) and a decode worker (rank 1) of one KV group, on
    `devices` (rollout, prefill, decode): the split's tokens equal the monolithic worker's, its logprobs within
    `atol`, and every payload byte came over the group when `grouped` (none otherwise). Yields (prefill, decode,
    requests) and stops the three at the end."""
    from deploy.local.service_process import start_service

    model = {"model": str(model_dir), **ENGINE, "engine.dtype": "float32"}  # float32 on a GPU too (atol)
    group = {"master": f"127.0.0.1:{port}", "world_size": 2, "backend": backend}
    started = []
    try:
        started.append(start_service("rollout", {**model, "engine.device": devices[0]}, log_dir=tmp_path))
        prefill = start_service("prefill", {**model, "engine.device": devices[1], "kv_group": {**group, "rank": 0}},
                                log_dir=tmp_path)
        started.append(prefill)
        decode = start_service("decode", {**model, "engine.device": devices[2], "prefill": [prefill.address],
                                          "kv_group": {**group, "rank": 1}, "server.metrics_port": 0}, log_dir=tmp_path)
        started.append(decode)
        for worker in (prefill, decode):
            wait_joined(worker, "joined" if grouped else "could not join")
        requests = [request_of(i, length, params) for i, (length, params) in enumerate(REQUESTS)]
        mono = asyncio.run(generate_all(started[0].address, requests))
        split = asyncio.run(generate_all(decode.address, requests))
        for reference, got in zip(mono, split):
            for (tokens, logprobs), (want_tokens, want_logprobs) in zip(tokens_and_logprobs(got),
                                                                        tokens_and_logprobs(reference)):
                assert tokens == want_tokens
                assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < atol
        moved = metric(decode, "relayrl_decode_kv_transfer_bytes_total")
        assert moved > 0 and metric(decode, "relayrl_decode_kv_group_bytes_total") == (moved if grouped else 0)
        yield prefill, decode, requests
    finally:
        for service in started:
            service.stop(timeout=10)


def test_payloads_go_over_the_group_and_the_split_still_equals_monolithic(sharp_model_dir, tmp_path, free_port):
    with split_equal_to_monolithic(sharp_model_dir, tmp_path, free_port) as (prefill, _, requests):
        # Over gRPC the same prefill worker still streams the payload to a caller outside the group.
        async def header_only_when_asked():
            async with connect(prefill.address) as channel:
                stub = kv_pb2_grpc.PrefillWorkerStub(channel)
                plain = [c async for c in stub.Prefill(kv_pb2.PrefillRequest(request=requests[0]), timeout=60)]
                return plain
        plain = asyncio.run(header_only_when_asked())
        assert not plain[0].header.HasField("payload_from_rank")
        assert sum(len(c.payload) for c in plain[1:]) == plain[0].header.payload_bytes > 0


@pytest.mark.gpu
def test_over_nccl_between_two_gpus_the_split_still_equals_monolithic(sharp_model_dir, tmp_path, free_port):
    """Prefill on cuda:0, decode (and the monolithic reference) on cuda:1: the payload moves GPU to GPU by NCCL."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA GPUs, this machine has {torch.cuda.device_count()}")
    with split_equal_to_monolithic(sharp_model_dir, tmp_path, free_port, "nccl", ("cuda:1", "cuda:0", "cuda:1"),
                                   atol=1e-4) as (prefill, decode, _):
        assert "nccl on cuda:0" in prefill.log_tail(200) and "nccl on cuda:1" in decode.log_tail(200)


@pytest.mark.gpu
def test_over_nccl_two_workers_on_one_gpu_are_refused_and_kv_goes_over_grpc(sharp_model_dir, tmp_path, free_port):
    """NCCL needs one GPU per member: both workers log the refusal naming both ranks, and the split still serves."""
    with split_equal_to_monolithic(sharp_model_dir, tmp_path, free_port, "nccl", ("cuda:0",) * 3, atol=1e-4,
                                   grouped=False) as (prefill, decode, _):
        for worker in (prefill, decode):
            assert "ranks 0 and 1 are both on GPU" in worker.log_tail(200)


def test_an_nccl_group_needs_the_engine_on_a_cuda_device():
    config = KVGroupConfig(master="127.0.0.1:1", world_size=2, rank=0, backend="nccl")
    for device in (None, torch.device("cpu"), torch.device("cuda")):
        with pytest.raises(ValueError, match="backend 'nccl' moves KV between GPUs"):
            KVGroup(config, device)


def test_the_group_sends_the_encoded_buffer_itself_and_the_kv_decodes_from_what_arrived(free_port, monkeypatch):
    """Over NCCL the group moved host bytes (encoded on the host, copied to the GPU, sent, copied back, decoded on the
    host, copied to the GPU again: issue 28). Now the buffer encode_payload makes on the engine's device is what the
    group sends, and the KV is decoded from the buffer recv fills, in place: on GPUs it never leaves them. gloo stands
    in for NCCL here: the same calls, on the host (NCCL needs two GPUs)."""
    from protos import rollout_pb2
    from rollout.kv.prefilled import PrefilledPrompt, ServedLayout
    from rollout.pd.transfer import encode_payload, pack, unpack

    config = {"master": f"127.0.0.1:{free_port}", "world_size": 2, "timeout_s": 30.0}
    sender, receiver = (KVGroup(KVGroupConfig(rank=rank, **config)) for rank in (0, 1))
    assert sender.wait_ready(30) and receiver.wait_ready(30)
    gen = torch.Generator().manual_seed(0)
    prefilled = PrefilledPrompt(prompt_ids=list(range(3, 23)), keys=torch.randn(2, 20, 2, 32, generator=gen),
                                values=torch.randn(2, 20, 2, 32, generator=gen), first_token_ids=[5],
                                first_logprobs=[-1.0], seed=7, weight_version=0)
    payload = encode_payload(prefilled, "none")
    sent, group = [], sender._group()

    class Spy:
        def send(self, tensors, dst, tag):
            sent.append(tensors[0])
            return group.send(tensors, dst, tag)

    monkeypatch.setattr(sender, "_group", Spy)
    thread = threading.Thread(target=sender.send, args=(payload, 1, 7))
    thread.start()
    received = receiver.recv(payload.numel(), 0, 7)
    thread.join(30)
    assert sent[0] is payload and isinstance(received, torch.Tensor) and received.dtype == torch.uint8
    (header,) = pack(rollout_pb2.GenerateRequest(request_id="r"), prefilled, "none", payload=payload,
                     payload_from_rank=0)
    served = ServedLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float32, vocab_size=101,
                          weight_version=0)
    got = unpack([header], served, received)
    assert torch.equal(got.prefilled.keys, prefilled.keys) and torch.equal(got.prefilled.values, prefilled.values)
    assert got.prefilled.keys.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
