"""Several senders of one version on the wire (BeginUpdate's sender_groups, each part's sender): the parts and groups
a receiver accepts, the version laid out from every sender's part, and a real WeightReceiver over a native engine that
commits only once every sender's part has arrived, played here by two senders on real gloo groups (the torchrun test of
pipeline stages is test_pipeline_publish.py)."""

import asyncio
import time
from dataclasses import replace

import grpc
import pytest
import torch

from protos import weights_pb2, weights_pb2_grpc
from protos.codec import CodecError
from rollout.config import EngineConfig
from rollout.engine.async_engine import AsyncEngine
from rollout.engine.llm_engine import LLMEngine
from rollout.serve.weight_receiver import WeightReceiver
from services.client import connect
from services.server import create_server
from services.weights import BucketSender, GroupSpec, deadline_after, host_store, make_group, merge_order
from services.weights.delta import WHOLE, BucketPart, parse_parts
from trainer.broadcast.config import BroadcastConfig
from trainer.broadcast.plan import BroadcastPlan
from trainer.broadcast.senders import join_parts, pack_part, sender_spec

torch.set_num_threads(1)


def _two_senders(state: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The tensors split in two, as two pipeline stages hold them: the first half (merge order) and the rest."""
    names = [name for name, _, _ in merge_order((n, t.shape, t.dtype) for n, t in state.items())]
    half = len(names) // 2
    return [{n: state[n] for n in names[:half]}, {n: state[n] for n in names[half:]}]


def test_every_sender_owns_its_buckets_and_each_part_names_one():
    state = {f"model.layers.{i}.mlp.up_proj.weight": torch.full((8, 4), float(i)) for i in range(4)}
    parts, packed = zip(*(pack_part(BroadcastPlan(BroadcastConfig(bucket_mb=0.0001)), t)
                          for t in _two_senders(state)), strict=True)
    manifest, wire = join_parts(parts)
    assert [p.sender for p in wire] == [0, 0, 1, 1] and [s.bucket for s in manifest.slots] == [0, 1, 2, 3]
    assert all(p.encoding == WHOLE and p.checksum for p in wire)
    assert set(packed[1]) == {s.name for s in manifest.slots if s.bucket >= 2}
    protos = [p.to_proto() for p in wire]
    assert parse_parts(manifest, protos, senders=2) == wire
    with pytest.raises(CodecError, match="from sender 1, but the update names 1 sender"):
        parse_parts(manifest, protos)  # an update naming no sender_groups: parts from sender 1 are refused
    with pytest.raises(CodecError, match=r"sender\(s\) \[2\] named but owning no bucket"):
        parse_parts(manifest, protos, senders=3)
    with pytest.raises(CodecError, match="no parts say which buckets are theirs"):
        parse_parts(manifest, [], senders=2)
    with pytest.raises(ValueError, match="is sent by senders 0 and 1"):
        join_parts([parts[0], parts[0]])


async def _serve(model_dir):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_blocks=32, max_num_seqs=2, max_n=1)))
    server, port = await create_server("127.0.0.1:0", [(weights_pb2_grpc.add_WeightSyncServicer_to_server,
                                                         WeightReceiver(engine), "relayrl.weights.v1.WeightSync")])
    await server.start()
    return engine, server, f"127.0.0.1:{port}"


def _send(spec: GroupSpec, store, sender: int, part, packed, timeout_s: float) -> float:
    """Sender `sender` forms its group (as its rank 0) and sends its buckets: how long that took."""
    started = time.monotonic()
    group = make_group(replace(sender_spec(spec, sender), rank=0), timeout_s, store)
    BucketSender().send(group, part.manifest, packed, deadline_after(timeout_s))
    group.close()
    return time.monotonic() - started


def test_a_receiver_commits_once_every_senders_part_arrived_and_a_missing_one_fails_the_version(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    versions = {v: {n: t.detach() + 0.01 * v for n, t in model.state_dict().items()} for v in (1, 2)}

    async def main():
        engine, server, address = await _serve(tiny_model_dir)
        channel = connect(address)
        stub = weights_pb2_grpc.WeightSyncStub(channel)
        store = await asyncio.to_thread(host_store, "127.0.0.1", 20.0)
        try:
            async def publish(version: int, senders: tuple[int, ...], timeout_s: float):
                packed_parts = [pack_part(BroadcastPlan(BroadcastConfig(bucket_mb=0.25)), t)
                                for t in _two_senders(versions[version])]
                manifest, parts = join_parts([part for part, _ in packed_parts])
                spec = GroupSpec("gloo", "127.0.0.1", store.port, 2, 1, f"two-senders-{version}")
                tensors, sizes = manifest.to_proto()
                await stub.BeginUpdate(weights_pb2.BeginUpdateRequest(
                    version=version, tensors=tensors, bucket_sizes=sizes, group=spec.to_proto(), timeout_s=timeout_s,
                    parts=[p.to_proto() for p in parts], sender_groups=[sender_spec(spec, 1).to_proto()]), timeout=10)
                # As the trainer does: the commit waits past the transfer's deadline (the receiver's own to fail by).
                commit = stub.CommitUpdate(weights_pb2.CommitUpdateRequest(version=version, timeout_s=timeout_s + 5),
                                           timeout=timeout_s + 15)
                sent = await asyncio.gather(*(asyncio.to_thread(_send, spec, store, s, *packed_parts[s], timeout_s)
                                              for s in senders))
                try:
                    return await commit, sent, parts
                except grpc.RpcError as exc:
                    return exc, sent, parts

            reply, _, parts = await publish(1, (0, 1), 20.0)
            assert {p.sender for p in parts} == {0, 1} and reply.current_version == 1
            served = dict(engine.engine.runner.model.named_parameters())
            assert served and all(torch.equal(t, versions[1][n]) for n, t in served.items())
            # Sender 1 never comes: the receiver takes sender 0's part (its send ends at once), then fails the version
            # when sender 1's group has not formed by the deadline, naming it; it keeps serving version 1.
            failure, sent, _ = await publish(2, (0,), 3.0)
            assert isinstance(failure, grpc.RpcError) and failure.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "the part of sender 1" in failure.details() and "its group did not form" in failure.details()
            assert "still serving version 1" in failure.details()
            assert sent[0] < 2.5, "sender 0's part waited for sender 1's group"
            assert engine.weight_version == 1
            served = dict(engine.engine.runner.model.named_parameters())
            assert all(torch.equal(t, versions[1][n]) for n, t in served.items())
        finally:
            await channel.close()
            await server.stop(1)
            engine.shutdown()

    asyncio.run(main())


def test_sender_groups_must_agree_with_the_group():
    spec = GroupSpec("gloo", "127.0.0.1", 1234, 2, 1, "g")
    request = weights_pb2.BeginUpdateRequest(group=spec.to_proto(),
                                             sender_groups=[replace(spec, rank=2, world_size=3).to_proto()])
    from rollout.serve.weight_receiver import _sender_groups

    with pytest.raises(CodecError, match=r"sender_groups\[0\]: backend gloo, rank 2 of 3; group says gloo, rank 1 of 2"):
        _sender_groups(request)
    request = weights_pb2.BeginUpdateRequest(group=spec.to_proto(), sender_groups=[spec.to_proto()])
    with pytest.raises(CodecError, match="a name of its own"):
        _sender_groups(request)
    assert BucketPart(0, WHOLE, 1, sender=1).to_proto().sender == 1
