"""Routing replay end to end through real services: a rollout process serving a tiny Qwen3-MoE submits a multi-turn
session (observations appended between policy turns, as a chat re-render does) to a real buffer process; the trainer
pulls the episode, collates it, and its replayed forward on the same weights runs, at every token the rollout
routed, exactly the rollout's experts, which its own routers pick too (float32 on both sides). A plain Generate's
completions carry their routes as well."""

import socket

import httpx
import numpy as np
import pytest
import torch

from protos import buffer_pb2, buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_tensor, encode_array
from protos.sample import ROUTE_DTYPES, Sample
from rollout.model.tiny import write_tiny_model
from services.client import connect
from trainer.batch import collate
from trainer.model import load_policy, run_policy

torch.set_num_threads(1)


@pytest.fixture
def moe_dir(tmp_path):
    return write_tiny_model(tmp_path / "moe", arch="qwen3_moe", seed=4, num_layers=3, mlp_only_layers=(1,),
                            hidden_size=64, num_heads=2, num_kv_heads=1)


async def turn(stub, session_id: str, seed: int) -> None:
    params = rollout_pb2.SamplingParams(max_tokens=5, temperature=1.0, seed=seed, logprobs=True)
    async for _ in stub.GenerateInSession(rollout_pb2.GenerateInSessionRequest(session_id=session_id, params=params,
                                                                                whole_turn=True)):
        pass


async def test_a_sessions_routes_reach_the_trainer_batch_aligned_and_replay_exactly(moe_dir, tmp_path,
                                                                                     service_factory):
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rollout = service_factory("rollout", {"model": str(moe_dir), "engine.torch_threads": 1,
                                          "engine.max_model_len": 128, "buffer": buffer.address, "openai.port": port,
                                          "openai.served_model_name": "moe"})
    async with connect(rollout.address) as channel, connect(buffer.address) as buffer_channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        reply = await stub.Generate(rollout_pb2.GenerateRequest(
            prompt_ids=encode_array([1, 30, 31, 32], "int32"),
            params=rollout_pb2.SamplingParams(max_tokens=4, temperature=1.0, n=2, seed=1)))
        for completion in reply.completions:
            routes = decode_tensor(completion.routed_experts, "routed_experts", ROUTE_DTYPES, 3)
            assert routes.shape == (4 + 4 - 1, 2, 2)  # prompt + completion but the last token, 2 sparse layers, top 2
        await stub.OpenSession(rollout_pb2.OpenSessionRequest(session_id="ep", prompt_ids=encode_array(
            [1, 40, 41, 42, 43], "int32")))
        for index in range(2):
            await turn(stub, "ep", seed=index)
            await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
                session_id="ep", token_ids=encode_array([50 + index, 51, 52], "int32")))
        await turn(stub, "ep", seed=2)
        closed = await stub.CloseSession(rollout_pb2.CloseSessionRequest(session_id="ep", reward=1.0, submit=True,
                                                                         group_size=1))
        assert closed.submitted
        buffer_stub = buffer_pb2_grpc.BufferStub(buffer_channel)
        pulled = [batch async for batch in buffer_stub.Pull(buffer_pb2.PullRequest(batch_size=1, max_batches=1),
                                                            timeout=30)]
    chat = await chat_session(f"http://127.0.0.1:{port}/v1")
    [sample] = [Sample.from_proto(message) for message in pulled[0].samples]
    total = sample.prompt_ids.size + sample.response_ids.size
    assert sample.routed_experts.shape == (total - 1, 2, 2) and sample.routed_experts.dtype == np.uint8
    assert (sample.loss_mask == 0).sum() == 6  # the two observations
    batch = collate([sample])
    policy = load_policy(moe_dir)
    with torch.no_grad():
        run_policy(policy, batch.input_ids, batch.attention_mask, routes=batch.routed_experts, replay=True)
    hooks = policy.router_hooks
    wanted = torch.from_numpy(sample.routed_experts.astype(np.int64))
    for layer in range(2):
        used, own = hooks.used[layer][: total - 1], hooks.own[layer][: total - 1]
        assert torch.equal(used, wanted[:, layer])
        assert torch.equal(own.sort(-1).values, wanted[:, layer].sort(-1).values)
    # the chat session (the second call re-renders the history; only the new messages are appended): its routes,
    # as the close route returns them, are those of its tokens
    tokens = chat["prompt_ids"] + chat["response_ids"]
    routes = torch.tensor(chat["routed_experts"])
    assert routes.shape == (len(tokens) - 1, 2, 2)
    with torch.no_grad():
        run_policy(policy, torch.tensor([tokens[:-1]]), torch.ones(1, len(tokens) - 1, dtype=torch.int64))
    assert torch.equal(torch.stack(hooks.own, 1).sort(-1).values, routes.sort(-1).values)


async def chat_session(base_url: str) -> dict:
    """Two chat calls of one session through the OpenAI endpoint, the second with the whole history; the close
    route's reply."""
    ask = [{"role": "user", "content": "2+3?"}]
    body = {"model": "moe", "max_tokens": 4, "temperature": 1.0, "seed": 1, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=60, headers={"X-Session-Id": "chat"}) as http:
        first = (await http.post("/chat/completions", json={**body, "messages": ask})).json()
        assert len(first["choices"][0]["routed_experts"]) > 0  # the choice's last delta carries its routes
        history = ask + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "and 5*6?"}]
        await http.post("/chat/completions", json={**body, "messages": history})
        return (await http.post("/sessions/chat/close", json={})).json()
