"""The WeightSync servicer in-process: a real gRPC server over a real AsyncEngine (native engine, tiny
model), driven by a real WeightBroadcaster and raw WeightSync calls; the protocol's refusals."""

import asyncio
import itertools

import grpc
import pytest
import torch

from protos import weights_pb2, weights_pb2_grpc
from rollout.config import EngineConfig
from rollout.engine.async_engine import AsyncEngine
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.serve.weight_receiver import WeightReceiver
from services.client import connect
from services.server import create_server
from services.weights import GroupSpec, deadline_after, host_store, make_group, merge_order, plan_buckets
from trainer.broadcast.blocking import BlockingWeightBroadcaster
from trainer.broadcast.broadcaster import WeightBroadcaster
from trainer.broadcast.config import BroadcastConfig

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tied_model_dir(tmp_path_factory):
    from rollout.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tied") / "qwen2", seed=3, tie_word_embeddings=True)


async def _serve(model_dir, **engine_args):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_blocks=32, max_num_seqs=4, max_n=4,
                                                **engine_args)))
    receiver = WeightReceiver(engine, layout=engine.parameter_layout())
    engine.receiver = receiver  # for the tests' eyes
    server, port = await create_server(
        "127.0.0.1:0", [(weights_pb2_grpc.add_WeightSyncServicer_to_server, receiver, "relayrl.weights.v1.WeightSync")]
    )
    await server.start()
    return engine, server, f"127.0.0.1:{port}"


def _run(model_dir, scenario, **engine_args):
    async def main():
        engine, server, address = await _serve(model_dir, **engine_args)
        try:
            return await scenario(engine, address)
        finally:
            await server.stop(1)
            engine.shutdown()

    return asyncio.run(main())


def test_a_tied_model_state_dict_is_published_once_and_lands_bit_exact(tied_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    state = model.state_dict()
    assert "lm_head.weight" in state  # the same storage as the embedding

    async def scenario(engine, address):
        # The synchronous wrapper a plain training loop uses (its own event loop on a thread).
        broadcaster = BlockingWeightBroadcaster([address], BroadcastConfig(timeout_s=20))
        report = await asyncio.to_thread(broadcaster.publish, state, 1)
        await asyncio.to_thread(broadcaster.close)
        return report, dict(engine.engine.runner.model.named_parameters())

    report, params = _run(tied_model_dir, scenario)
    assert report.ok, report.failed
    assert report.bytes < sum(t.numel() * 4 for t in state.values())  # lm_head did not travel twice
    assert params.keys() == state.keys() - {"lm_head.weight"}
    for name, param in params.items():
        assert torch.equal(param, state[name]), name


def _begin(address, manifest, version, group, timeout_s=5.0):
    specs, sizes = manifest.to_proto()
    request = weights_pb2.BeginUpdateRequest(version=version, tensors=specs, bucket_sizes=sizes,
                                             group=group.to_proto(), timeout_s=timeout_s)
    return request


def test_the_receiver_refuses_what_it_cannot_apply_and_keeps_its_version(tied_model_dir, free_port):
    port = free_port  # nobody listens there: a rendezvous store that never answers

    async def scenario(engine, address):
        layout = engine.parameter_layout()
        good = plan_buckets([(name, shape, dtype) for name, (shape, dtype) in layout.items()], 1 << 20)
        group = GroupSpec("gloo", "127.0.0.1", port, 2, 1, "refusals")
        first = next(iter(layout))
        codes = {}
        async with connect(address) as channel:
            stub = weights_pb2_grpc.WeightSyncStub(channel)

            async def code(call, request):
                try:
                    await call(request, timeout=5)
                except grpc.RpcError as exc:
                    return exc.code(), exc.details()
                return grpc.StatusCode.OK, ""

            begin = stub.BeginUpdate
            codes["stale version"] = await code(begin, _begin(address, good, 0, group))
            codes["missing tensor"] = await code(begin, _begin(address, plan_buckets(
                [(n, s, d) for n, (s, d) in layout.items() if n != first], 1 << 20), 1, group))
            codes["wrong dtype"] = await code(begin, _begin(address, plan_buckets(
                [(n, s, torch.bfloat16 if n == first else d) for n, (s, d) in layout.items()], 1 << 20), 1, group))
            codes["bad rank"] = await code(begin, _begin(address, good, 1,
                                                         GroupSpec("gloo", "127.0.0.1", port, 2, 0, "refusals")))
            codes["bad backend"] = await code(begin, _begin(address, good, 1,
                                                            GroupSpec("mpi", "127.0.0.1", port, 2, 1, "refusals")))
            codes["nccl on cpu"] = await code(begin, _begin(address, good, 1,
                                                            GroupSpec("nccl", "127.0.0.1", port, 2, 1, "refusals")))
            codes["unknown group"] = await code(begin, _begin(address, good, 1, GroupSpec(
                "gloo", "127.0.0.1", port, 2, 1, "never-formed", existing=True)))
            codes["commit unbegun"] = await code(stub.CommitUpdate, weights_pb2.CommitUpdateRequest(version=1))
            # The commit reports the failed join (nobody hosts the store), it does not hang.
            codes["begin ok"] = await code(begin, _begin(address, good, 1, group, timeout_s=1.0))
            codes["commit failed join"] = await code(stub.CommitUpdate,
                                                     weights_pb2.CommitUpdateRequest(version=1, timeout_s=5))
            codes["abort"] = await code(stub.AbortUpdate, weights_pb2.AbortUpdateRequest(version=1))
        return codes, engine.weight_version

    codes, version = _run(tied_model_dir, scenario)
    assert version == 0
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert codes["stale version"][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert codes["missing tensor"][0] == invalid and "lacks" in codes["missing tensor"][1]
    assert codes["wrong dtype"][0] == invalid and "bfloat16" in codes["wrong dtype"][1]
    assert codes["bad rank"][0] == invalid and codes["bad backend"][0] == invalid
    assert codes["unknown group"][0] == grpc.StatusCode.ABORTED
    # An engine on the CPU cannot take CUDA buckets: said at once, not by a failed join later.
    assert codes["nccl on cpu"][0] == grpc.StatusCode.FAILED_PRECONDITION and "cuda:N" in codes["nccl on cpu"][1]
    assert codes["commit unbegun"][0] == grpc.StatusCode.FAILED_PRECONDITION
    assert codes["begin ok"][0] == grpc.StatusCode.OK
    assert codes["commit failed join"][0] in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert "still serving version 0" in codes["commit failed join"][1]
    assert codes["abort"][0] == grpc.StatusCode.OK


def test_staging_is_double_buffered_and_a_failed_update_leaves_the_served_bytes_alone(tied_model_dir):
    """The engine serves the staged tensors themselves, so an update lands in the other set of buffers:
    versions 1 and 3 share one set, 2 the other; a transfer that dies half-way through version 4 writes
    into the free set and the served version 3 keeps computing what it did."""
    config = BroadcastConfig(bucket_mb=0.05, timeout_s=20)

    async def scenario(engine, address):
        model = engine.engine.runner.model
        base = {name: param.clone() for name, param in model.named_parameters()}
        updates = [{name: t + 0.01 * version for name, t in base.items()} for version in (1, 2, 3)]
        where = []
        async with WeightBroadcaster([address], config) as broadcaster:
            for version, weights in enumerate(updates, start=1):
                report = await broadcaster.publish(weights, version)
                assert report.ok, report.failed
                where.append(model.model.embed_tokens.weight.data_ptr())
                assert all(torch.equal(param, weights[name]) for name, param in model.named_parameters())
        greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        before = await engine.generate_all("before", [5, 6, 7], greedy)

        # Version 4, laid out as the broadcaster lays it out, from a trainer that stops after half the buckets.
        key = [(name, tuple(t.shape), t.dtype) for name, t in updates[0].items()]
        manifest = plan_buckets(merge_order(key), int(config.bucket_mb * (1 << 20)))
        store = host_store("127.0.0.1", timeout_s=20)
        spec = GroupSpec("gloo", "127.0.0.1", store.port, 2, 1, "half-way")
        async with connect(address) as channel:
            stub = weights_pb2_grpc.WeightSyncStub(channel)
            await stub.BeginUpdate(_begin(address, manifest, 4, spec, timeout_s=20), timeout=10)
            sender = await asyncio.to_thread(make_group, GroupSpec("gloo", "127.0.0.1", store.port, 2, 0, "half-way"),
                                             20, store)
            garbage = [torch.full((size,), 255, dtype=torch.uint8) for size in manifest.bucket_sizes]
            for bucket in garbage[: len(garbage) // 2]:
                sender.broadcast(bucket).wait(deadline_after(20))
            with pytest.raises(grpc.RpcError) as failure:
                await stub.CommitUpdate(weights_pb2.CommitUpdateRequest(version=4, timeout_s=1.0), timeout=10)
            sender.close()
        after = await engine.generate_all("after", [5, 6, 7], greedy)
        served = all(torch.equal(param, updates[2][name]) for name, param in model.named_parameters())
        return where, failure.value.code(), engine.weight_version, served, before, after

    where, code, version, served, before, after = _run(tied_model_dir, scenario)
    assert where[0] == where[2] != where[1]
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and version == 3
    assert served and [c.token_ids for c in after] == [c.token_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before]


def test_a_bound_model_is_published_from_its_own_memory_and_lands_bit_exact(tied_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tied_model_dir, dtype=torch.float32)

    async def scenario(engine, address):
        async with WeightBroadcaster([address], BroadcastConfig(timeout_s=20)) as broadcaster:
            broadcaster.bind(dict(model.named_parameters()))
            reports = []
            for version in (1, 2):
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(0.01)  # an optimizer step, in place
                reports.append(await broadcaster.publish(model.state_dict(), version))
            served_2 = {name: p.clone() for name, p in engine.engine.runner.model.named_parameters()}
            expected_2 = {name: t.clone() for name, t in model.state_dict().items()}
            # An overlapped publish: a snapshot, sent while the parameters take the next step.
            snapshot = broadcaster.snapshot()
            expected_3 = {name: t.clone() for name, t in model.state_dict().items()}
            sending = asyncio.create_task(broadcaster.publish(snapshot, 3))
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(0.01)
            reports.append(await sending)
            packed = broadcaster._transport._sender._buffers
        served_3 = dict(engine.engine.runner.model.named_parameters())
        return reports, packed, (served_2, expected_2), (served_3, expected_3)

    reports, packed, (served_2, expected_2), (served_3, expected_3) = _run(tied_model_dir, scenario)
    assert all(report.ok for report in reports), [report.failed for report in reports]
    assert packed == []  # one bucket, sent straight from the parameters' (then the snapshot's) memory
    assert not torch.equal(model.model.embed_tokens.weight, expected_3["model.embed_tokens.weight"])
    for name, param in served_3.items():
        assert torch.equal(served_2[name], expected_2[name]), name
        assert torch.equal(param, expected_3[name]), name


def test_the_engines_pause_is_reported_apart_from_the_sync(tied_model_dir):
    """CommitUpdate says how long the engine generated nothing for the update (its own measure, from its last step
    to the switch's end): positive, within the publish's sync time, and at least the switch, while the engine
    generates all along."""
    async def scenario(engine, address):
        model = engine.engine.runner.model
        base = {name: param.clone() for name, param in model.named_parameters()}
        params = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True)
        published, seen = asyncio.Event(), set()

        async def generate():  # until the publishes are done, and once more
            for turn in itertools.count():
                seen.update((await engine.generate_all(f"g{turn}", [5, 6, 7], params))[0].weight_versions)
                if published.is_set():
                    return

        generating = asyncio.create_task(generate())
        await asyncio.sleep(0.1)  # the engine is stepping when the updates come
        reports = []
        async with WeightBroadcaster([address], BroadcastConfig(bucket_mb=0.05, timeout_s=20)) as broadcaster:
            for version in (1, 2):
                reports.append(await broadcaster.publish({n: t + 0.01 * version for n, t in base.items()}, version))
        published.set()
        await generating
        return reports, seen

    reports, seen = _run(tied_model_dir, scenario)
    for report in reports:
        assert report.ok, report.failed
        [result] = report.results
        assert 0 < report.pause_s == result.pause_s <= report.total_s
        assert result.pause_s >= result.switch_s > 0
    assert {0, 2} <= seen


def test_a_float32_update_may_widen_into_a_bf16_engine_and_nothing_else():
    """A float32 trainer publishing to an engine in bfloat16 (the default on a GPU since issue 34): with `widen` (a
    receiver that stages the update, the engine casting it at the switch) float32 tensors update bfloat16 / float16
    parameters; a narrower update, another dtype, or any cast without `widen` is still refused."""
    from protos.codec import CodecError
    from rollout.serve.weight_receiver import check_layout

    layout = {"a": ((2, 3), torch.bfloat16), "b": ((4,), torch.float16), "c": ((5,), torch.float32)}
    widened = plan_buckets([("a", (2, 3), torch.float32), ("b", (4,), torch.float32), ("c", (5,), torch.float32)],
                           1 << 20)
    check_layout(widened, layout, widen=True)
    with pytest.raises(CodecError, match="tensor 'a': the update has \\[2, 3\\] torch.float32, the model"):
        check_layout(widened, layout)
    narrowed = plan_buckets([("a", (2, 3), torch.bfloat16), ("b", (4,), torch.float16), ("c", (5,), torch.bfloat16)],
                            1 << 20)
    with pytest.raises(CodecError, match="tensor 'c': the update has \\[5\\] torch.bfloat16, the model \\[5\\] "
                                         "torch.float32"):
        check_layout(narrowed, layout, widen=True)


def test_an_engine_replaying_graphs_copies_each_update_and_one_staging_set_serves_them_all(tied_model_dir):
    """With static decode buffers (cuda_graphs; on CPU plain calls on the same buffers) the engine copies every update
    into the parameters its graphs were captured with: their storage never moves, and the receiver, told so by
    `adopts_weights`, reuses one staging set instead of holding the served version's beside it."""
    config = BroadcastConfig(bucket_mb=0.05, timeout_s=20)

    async def scenario(engine, address):
        model = engine.engine.runner.model
        storage = {name: param.data_ptr() for name, param in model.named_parameters()}
        base = {name: param.clone() for name, param in model.named_parameters()}
        staged = []
        async with WeightBroadcaster([address], config) as broadcaster:
            for version in (1, 2, 3):
                weights = {name: t + 0.01 * version for name, t in base.items()}
                report = await broadcaster.publish(weights, version)
                assert report.ok, report.failed
                assert all(torch.equal(param, weights[name]) for name, param in model.named_parameters())
                receiver = engine.receiver
                staged.append((receiver._served, [t.data_ptr() for t in receiver._staging.buffers]))
        moved = {name for name, param in model.named_parameters() if param.data_ptr() != storage[name]}
        return engine.adopts_weights, moved, staged

    adopts, moved, staged = _run(tied_model_dir, scenario, cuda_graphs=True)
    assert not adopts and moved == set()
    assert [served for served, _ in staged] == [None] * 3
    assert staged[0][1] == staged[1][1] == staged[2][1]
