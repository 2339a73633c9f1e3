"""Several rollout replicas behind the router, real processes on loopback (rollout/router/router.py, router_service.py):
requests spread by load and a killed replica's requests (and reads) re-run elsewhere, sessions sticky across a router
restart, a replica added mid-run receiving the trainer's weights before traffic, and a removed one draining."""

import asyncio
import time
import urllib.request

import grpc
import pytest

from protos import rollout_pb2, rollout_pb2_grpc, router_pb2, router_pb2_grpc
from protos.codec import decode_array, encode_array
from services.client import connect

ENGINE = {"engine.max_model_len": 512, "engine.torch_threads": 1}


def request_of(i: int, max_tokens: int) -> rollout_pb2.GenerateRequest:
    prompt = [3 + (i * 7 + j) % 90 for j in range(8 + i)]
    return rollout_pb2.GenerateRequest(request_id=f"r{i}", prompt_ids=encode_array(prompt, "int32"),
                                       params=rollout_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                                                         ignore_eos=True, seed=100 + i))


def tokens(response: rollout_pb2.GenerateResponse) -> list[int]:
    return decode_array(response.completions[0].token_ids).tolist()


def versions(response: rollout_pb2.GenerateResponse) -> set[int]:
    return {int(v) for c in response.completions for v in decode_array(c.weight_versions)}


def generated_tokens(service) -> float:
    """relayrl_rollout_generated_tokens_total of a replica (its /metrics)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=10).read().decode()
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("relayrl_rollout_generated_tokens_total ")))


def replicas(router_address: str) -> dict[str, router_pb2.ReplicaInfo]:
    with grpc.insecure_channel(router_address) as channel:
        reply = router_pb2_grpc.ReplicasStub(channel).ListReplicas(router_pb2.ListReplicasRequest(), timeout=10)
    return {info.address: info for info in reply.replicas}


async def running(address: str) -> int:
    async with connect(address) as channel:
        return (await rollout_pb2_grpc.RolloutStub(channel).GetLoad(rollout_pb2.GetLoadRequest(), timeout=10)).running


async def until_running(*addresses: str, within_s: float = 60.0) -> None:
    """Until every replica at `addresses` decodes sequences at once."""
    channels = [connect(address) for address in addresses]
    stubs = [rollout_pb2_grpc.RolloutStub(channel) for channel in channels]
    deadline = time.monotonic() + within_s
    try:
        while not all([(await stub.GetLoad(rollout_pb2.GetLoadRequest(), timeout=10)).running for stub in stubs]):
            assert time.monotonic() < deadline, f"{addresses} never all ran sequences at once"
            await asyncio.sleep(0.005)
    finally:
        for channel in channels:
            await channel.close()


def start_router(start, model_dir, addresses: list[str]):
    return start("rollout", {"model": str(model_dir), "router.replicas": addresses, "router.poll_s": 0.2})


@pytest.mark.slow  # 35-80 s on this shared 2-core machine (5 processes)
def test_requests_spread_over_replicas_and_a_killed_replicas_requests_complete_elsewhere(service_factory,
                                                                                          sharp_model_dir):
    model = {"model": str(sharp_model_dir), **ENGINE}
    a, b = service_factory("rollout", model), service_factory("rollout", model)
    router = start_router(service_factory, sharp_model_dir, [a.address, b.address])
    requests = [request_of(i, 400) for i in range(8)]

    async def run():
        async with connect(a.address) as channel:  # the reference: one replica alone, the same seeds
            stub = rollout_pb2_grpc.RolloutStub(channel)
            alone = await asyncio.gather(*(stub.Generate(r, timeout=300) for r in requests))
        while any(r.running for r in replicas(router.address).values()):  # the router's polls see a idle again
            await asyncio.sleep(0.1)
        async with connect(router.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            calls = [asyncio.ensure_future(stub.Generate(r, timeout=300)) for r in requests]
            await until_running(a.address, b.address)  # both replicas took some
            b.kill()  # mid-generation: it holds running sequences
            killed_at = time.monotonic()
            return alone, await asyncio.gather(*calls), killed_at

    alone, routed, killed_at = asyncio.run(run())
    assert [tokens(r) for r in routed] == [tokens(r) for r in alone]  # every request complete, the same tokens
    while replicas(router.address)[b.address].alive:
        assert time.monotonic() - killed_at < 5, "the router still routes to the dead replica"
        time.sleep(0.1)
    assert replicas(router.address)[a.address].state == router_pb2.REPLICA_STATE_ACTIVE


def test_reads_through_the_router_are_rerun_on_another_replica_when_theirs_just_died(service_factory,
                                                                                     tiny_model_dir):
    """The driver polls GetWeightVersion through the router every few ms; the replica the router picks for it may
    have died since the router's last poll. Before the fix the router let the replica's UNAVAILABLE escape its
    handler as UNKNOWN, which the driver does not retry: it exited (issue 16)."""
    model = {"model": str(tiny_model_dir), **ENGINE}
    a, b = service_factory("rollout", model), service_factory("rollout", model)
    # No poll of the router notices the death first: the reads below find it.
    router = service_factory("rollout", {"model": str(tiny_model_dir), "router.replicas": [a.address, b.address],
                                         "router.poll_s": 600})
    a.kill()  # of two idle replicas the router picks the first listed
    logprobs = rollout_pb2.ComputeLogprobsRequest(prompt_ids=encode_array([5, 6, 7], "int32"),
                                                  response_ids=[encode_array([8, 9], "int32")], temperature=1.0)
    with grpc.insecure_channel(router.address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        for _ in range(2):
            assert stub.GetWeightVersion(rollout_pb2.GetWeightVersionRequest(), timeout=30).version == 0
            assert stub.GetModelInfo(rollout_pb2.GetModelInfoRequest(), timeout=30).vocab_size > 0
            assert len(stub.ComputeLogprobs(logprobs, timeout=30).logprobs) == 1
    listed = replicas(router.address)
    assert not listed[a.address].alive and listed[b.address].alive  # dropped by the failed call, not a poll


@pytest.mark.slow  # 35-80 s on this shared 2-core machine (5 processes)
def test_sessions_stick_to_their_replica_across_a_router_restart(service_factory, sharp_model_dir):
    model = {"model": str(sharp_model_dir), **ENGINE}
    a, b = service_factory("rollout", model), service_factory("rollout", model)
    first = start_router(service_factory, sharp_model_dir, [a.address, b.address])
    greedy = rollout_pb2.SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def turn(stub, session_id: str, observation: list[int]) -> None:
        await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
            session_id=session_id, token_ids=encode_array(observation, "int32")), timeout=30)
        [c async for c in stub.GenerateInSession(rollout_pb2.GenerateInSessionRequest(
            session_id=session_id, params=greedy, whole_turn=True), timeout=30)]

    async def open_sessions(address: str) -> list[str]:
        async with connect(address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            ids = []
            for i, session_id in enumerate(["", "", "env-0", "env-1", ""]):  # "": the router makes the id
                opened = await stub.OpenSession(rollout_pb2.OpenSessionRequest(
                    session_id=session_id, prompt_ids=encode_array([5 + i] * 20, "int32")), timeout=30)
                ids.append(opened.session_id)
                [c async for c in stub.GenerateInSession(rollout_pb2.GenerateInSessionRequest(
                    session_id=opened.session_id, params=greedy, whole_turn=True), timeout=30)]
                await asyncio.sleep(0.5)  # a load poll sees the last one's blocks: the next goes elsewhere
            return ids

    ids = asyncio.run(open_sessions(first.address))
    minted = [session_id for session_id in ids if "@" in session_id]
    assert len(minted) == 3 and {s.rsplit("@", 1)[1] for s in minted} == {a.address, b.address}
    first.stop(timeout=10)
    second = start_router(service_factory, sharp_model_dir, [a.address, b.address])  # knows no session

    async def go_on() -> list[int]:
        async with connect(second.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            for session_id in ids[:4]:
                await turn(stub, session_id, [7, 8, 9])
            closed = [await stub.CloseSession(rollout_pb2.CloseSessionRequest(session_id=s), timeout=30)
                      for s in ids[:4]]
            return [c.sample.response_ids.length for c in closed]

    assert asyncio.run(go_on()) == [5 + 3 + 5] * 4  # every session found where its KV lives, turns in order
    holder = a if ids[4].endswith(a.address) else b
    holder.kill()

    async def lost() -> grpc.aio.AioRpcError:
        async with connect(second.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await turn(rollout_pb2_grpc.RolloutStub(channel), ids[4], [1])
            return failed.value

    error = asyncio.run(lost())
    assert error.code() == grpc.StatusCode.UNAVAILABLE and holder.address in error.details()


def test_a_restarted_router_keeps_the_replicas_it_was_given_since_it_started(service_factory, sharp_model_dir,
                                                                             tmp_path):
    """Scaled (or replaced) replicas outlive a restart of the router: its replica set is kept in replicas_file, so the
    restarted process routes to what it had, not to the list it was started with."""
    model = {"model": str(sharp_model_dir), **ENGINE, "server.metrics_port": 0}
    a, b = service_factory("rollout", model), service_factory("rollout", model)
    router = service_factory("rollout", {"model": str(sharp_model_dir), "router.replicas": [a.address],
                                         "router.poll_s": 0.2, "router.replicas_file": str(tmp_path / "set.json")})
    with grpc.insecure_channel(router.address) as channel:
        control = router_pb2_grpc.ReplicasStub(channel)
        control.AddReplica(router_pb2.AddReplicaRequest(address=b.address, wait_s=30), timeout=60)
        control.RemoveReplica(router_pb2.RemoveReplicaRequest(address=a.address, drain_timeout_s=10), timeout=30)
    router.restart(timeout=120)  # started again with router.replicas: [a], as the supervisor would
    assert list(replicas(router.address)) == [b.address]
    served = asyncio.run(generate(router.address, [request_of(i, 4) for i in range(3)]))
    assert all(len(tokens(r)) == 4 for r in served) and generated_tokens(b) > 0 and generated_tokens(a) == 0


def test_a_replica_added_mid_run_gets_the_trainers_weights_before_traffic_and_a_removed_one_drains(
        service_factory, sharp_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.config.publish import PublishConfig
    from trainer.run import RolloutPublisher

    model = {"model": str(sharp_model_dir), **ENGINE, "server.metrics_port": 0}
    a = service_factory("rollout", model)
    router = start_router(service_factory, sharp_model_dir, [a.address])
    base = AutoModelForCausalLM.from_pretrained(sharp_model_dir, dtype=torch.float32).state_dict()
    gen = torch.Generator().manual_seed(3)
    publisher = RolloutPublisher(PublishConfig(receivers_from=router.address, timeout_s=60))
    control = router_pb2_grpc.ReplicasStub(grpc.insecure_channel(router.address))
    try:
        assert publisher({k: t + torch.randn(t.shape, generator=gen) * 0.02 for k, t in base.items()}, 1) == 1
        b = service_factory("rollout", model)
        joined = control.AddReplica(router_pb2.AddReplicaRequest(address=b.address), timeout=10)
        assert joined.state == router_pb2.REPLICA_STATE_JOINING and joined.weight_version == 0
        before = asyncio.run(generate(router.address, [request_of(i, 8) for i in range(6)]))
        assert all(versions(r) == {1} for r in before) and generated_tokens(b) == 0  # no traffic while it joins
        assert publisher.served_versions() == {a.address: 1, b.address: 0}  # the trainer sees it behind
        publisher({k: t + torch.randn(t.shape, generator=gen) * 0.02 for k, t in base.items()}, 2)
        joined = control.AddReplica(router_pb2.AddReplicaRequest(address=b.address, wait_s=10), timeout=20)
        assert joined.state == router_pb2.REPLICA_STATE_ACTIVE and joined.weight_version == 2
        after = asyncio.run(generate(router.address, [request_of(i, 8) for i in range(8)]))
        assert all(versions(r) == {2} for r in after) and generated_tokens(b) > 0

        for bad, code in ((router_pb2.AddReplicaRequest(address="nowhere"), grpc.StatusCode.INVALID_ARGUMENT),
                          (router_pb2.RemoveReplicaRequest(address="127.0.0.1:1"), grpc.StatusCode.NOT_FOUND)):
            call = control.AddReplica if isinstance(bad, router_pb2.AddReplicaRequest) else control.RemoveReplica
            with pytest.raises(grpc.RpcError) as refused:
                call(bad, timeout=10)
            assert refused.value.code() == code

        async def scale_down():
            async with connect(router.address) as channel:
                stub = rollout_pb2_grpc.RolloutStub(channel)
                calls = [asyncio.ensure_future(stub.Generate(request_of(i, 400), timeout=300)) for i in range(8)]
                await until_running(b.address)
                async with connect(router.address) as admin:
                    removal = router_pb2_grpc.ReplicasStub(admin).RemoveReplica(
                        router_pb2.RemoveReplicaRequest(address=b.address, drain_timeout_s=120), timeout=200)
                    return await removal, await asyncio.gather(*calls), await running(b.address)

        removed, drained_calls, left_running = asyncio.run(scale_down())
        assert removed.drained and removed.in_flight == 0
        assert [len(tokens(r)) for r in drained_calls] == [400] * 8 and left_running == 0  # no request lost
        assert list(replicas(router.address)) == [a.address]
        with pytest.raises(grpc.RpcError) as last:
            control.RemoveReplica(router_pb2.RemoveReplicaRequest(address=a.address), timeout=10)
        assert last.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert publisher.served_versions() == {a.address: 2}  # the trainer follows: b gets no more weights
    finally:
        publisher.close()


async def generate(address: str, requests) -> list[rollout_pb2.GenerateResponse]:
    async with connect(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        return await asyncio.gather(*(stub.Generate(r, timeout=300) for r in requests))


@pytest.mark.slow  # 35-80 s on this shared 2-core machine (5 processes)
def test_the_openai_endpoint_spreads_over_replicas_and_keeps_a_session_on_its_replica(service_factory,
                                                                                       tiny_model_dir):
    import socket

    import httpx

    model = {"model": str(tiny_model_dir), **ENGINE, "openai.port": 0, "openai.served_model_name": "tiny"}
    a, b = service_factory("rollout", model), service_factory("rollout", model)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    service_factory("rollout", {"model": str(tiny_model_dir), "router.replicas": [a.address, b.address],
                                "router.poll_s": 0.2, "openai.port": port})  # the router, its endpoint on `port`
    ask = [{"role": "user", "content": "what is 12*34?"}]

    async def chat(http, session: str, messages) -> dict:
        reply = await http.post("/chat/completions", headers={"X-Session-Id": session}, json={
            "model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 1.0, "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        return reply.json()

    async def run():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", timeout=60) as http:
            models = (await http.get("/models")).json()
            first = {}
            for i in range(4):
                first[f"s{i}"] = await chat(http, f"s{i}", ask)
                await asyncio.sleep(0.5)  # a poll sees the session's blocks: the next goes to the other replica
            open_on = [await sessions_on(a.address), await sessions_on(b.address)]
            for session, reply in first.items():  # each second turn must reach the replica holding the first
                await chat(http, session, ask + [{"role": "assistant", "content": reply["choices"][0]["message"]
                                                  ["content"]}, {"role": "user", "content": "and 5*6?"}])
            closed = [(await http.post(f"/sessions/s{i}/close", json={})).json() for i in range(3)]
            plain = await http.post("/completions", json={"model": "tiny", "prompt": "12+3=", "max_tokens": 3})
            return models, open_on, closed, plain

    models, open_on, closed, plain = asyncio.run(run())
    assert models["data"][0]["id"] == "tiny" and plain.status_code == 200
    assert open_on == [2, 2]  # spread by load
    assert all(sample["stats"]["turns"] == 2 for sample in closed)  # both turns on the replica that held it
    holder = a if asyncio.run(sessions_on(a.address)) else b
    holder.kill()

    async def lost():
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}/v1", timeout=60) as http:
            return await http.post("/chat/completions", headers={"X-Session-Id": "s3"}, json={
                "model": "tiny", "messages": ask, "max_tokens": 2})

    gone = asyncio.run(lost())
    assert gone.status_code == 503 and holder.address in gone.json()["error"]["message"]


async def sessions_on(address: str) -> int:
    async with connect(address) as channel:
        return (await rollout_pb2_grpc.RolloutStub(channel).GetLoad(rollout_pb2.GetLoadRequest(), timeout=10)).sessions


def test_a_resumed_run_starts_as_many_replicas_as_it_was_scaled_to(tmp_path):
    from deploy.local.replicas import request_path, result_path, scaled_replicas, write_json

    assert scaled_replicas(tmp_path, "rollout") is None  # never scaled: the configured count
    write_json(request_path(tmp_path, "rollout"), {"id": "a", "replicas": 3})
    assert scaled_replicas(tmp_path, "rollout") is None  # asked, never answered: nothing changed
    write_json(result_path(tmp_path, "rollout"), {"id": "a", "replicas": ["rollout-1", "rollout-2", "rollout-4"],
                                                  "added": ["rollout-4"], "removed": {}})
    assert scaled_replicas(tmp_path, "rollout") == 3
    # a request that failed half-way answers with the replicas it left running
    write_json(result_path(tmp_path, "rollout"), {"id": "b", "replicas": ["rollout-1", "rollout-2", "rollout-4",
                                                                          "rollout-5"], "error": "rollout-6 failed"})
    assert scaled_replicas(tmp_path, "rollout") == 4


def test_a_re_run_chunk_cut_by_the_router_keeps_its_kv_version():
    from rollout.router.service import _tail

    chunk = rollout_pb2.GenerateChunk(request_id="r", index=0, token_ids=encode_array([5, 6, 7], "int32"),
                                      logprobs=encode_array([-1.0, -2.0, -3.0], "float32"),
                                      weight_versions=encode_array([2, 2, 3], "int64"),
                                      finish_reason=rollout_pb2.FINISH_REASON_STOP, kv_version=2)
    cut = _tail(chunk, 2)
    assert decode_array(cut.token_ids).tolist() == [7] and decode_array(cut.weight_versions).tolist() == [3]
    assert cut.HasField("kv_version") and cut.kv_version == 2
    chunk.ClearField("kv_version")
    assert not _tail(chunk, 1).HasField("kv_version")
