"""Delta sync (`delta: auto`) end to end: a real WeightBroadcaster, real gloo groups and WeightReceivers over real
AsyncEngines serving a tiny model in bfloat16. Versions after the first travel as the changed words; the engines'
weights stay bit-identical to the trainer's cast; a replica that missed a version gets it whole (counted); an old
client (no base_version) still updates whole."""

import asyncio

import pytest
import torch

from protos import weights_pb2_grpc
from rollout.config import EngineConfig
from rollout.engine.async_engine import AsyncEngine
from rollout.engine.llm_engine import LLMEngine
from rollout.serve.weight_receiver import WeightReceiver
from services.server import create_server
from services.weights import Manifest, TensorSlot
from services.weights.delta import DELTA, WHOLE, ChecksumMismatch, encode_bucket, receive_parts, word_dtype
from trainer.broadcast.broadcaster import WeightBroadcaster
from trainer.broadcast.config import BroadcastConfig

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rollout.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("delta") / "qwen2", seed=5)


@pytest.fixture(scope="module")
def trainer_state(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


async def _serve(model_dir, port=0):
    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(model_dir), num_blocks=32, max_num_seqs=2, max_n=2,
                                                dtype="bfloat16")))
    receiver = WeightReceiver(engine, layout=engine.parameter_layout())
    server, port = await create_server(
        f"127.0.0.1:{port}", [(weights_pb2_grpc.add_WeightSyncServicer_to_server, receiver, "relayrl.weights.v1.WeightSync")]
    )
    await server.start()
    return engine, server, f"127.0.0.1:{port}"


def _run(model_dir, replicas, scenario):
    async def main():
        served = [await _serve(model_dir) for _ in range(replicas)]
        try:
            return await scenario([engine for engine, _, _ in served], [address for _, _, address in served])
        finally:
            for engine, server, _ in served:
                await server.stop(1)
                engine.shutdown()

    return asyncio.run(main())


def _step(state, generator, fraction=0.01):
    """A small update: `fraction` of each tensor's weights move by ~2%, enough to change their bfloat16 words."""
    with torch.no_grad():
        for tensor in state.values():
            mask = torch.rand(tensor.shape, generator=generator) < fraction
            tensor.add_(mask * tensor * 0.02 * torch.sign(torch.randn(tensor.shape, generator=generator)))


async def _publish_steps(broadcaster, state, generator, versions, reports) -> None:
    """One optimizer-like step of `state`, then its publish, per version; each publish's report in `reports`."""
    for version in versions:
        _step(state, generator)
        reports[version] = await broadcaster.publish(state, version)


def _assert_serves(engine, state):
    params = dict(engine.engine.runner.model.named_parameters())
    assert params
    for name, param in params.items():
        assert torch.equal(param, state[name].to(torch.bfloat16)), name


def _config(delta="auto"):
    return BroadcastConfig(timeout_s=20, dtype="bfloat16", delta=delta, bucket_mb=0.25)


def test_delta_sync_is_bit_exact_after_50_versions_at_a_tenth_of_the_bytes(model_dir, trainer_state):
    state = {name: tensor.clone() for name, tensor in trainer_state.items()}
    generator = torch.Generator().manual_seed(0)

    async def scenario(engines, addresses):
        reports = []
        async with WeightBroadcaster(addresses, _config()) as broadcaster:
            for version in range(1, 51):
                if version > 1:
                    _step(state, generator)
                reports.append(await broadcaster.publish(state, version))
                assert reports[-1].ok, (version, reports[-1].failed)
        _assert_serves(engines[0], state)
        return reports

    reports = _run(model_dir, 1, scenario)
    assert not reports[0].partial and reports[0].bytes == reports[0].full_bytes
    assert all(report.partial for report in reports[1:])
    assert reports[-1].fallbacks == 0
    ratio = sum(r.bytes for r in reports[1:]) / sum(r.full_bytes for r in reports[1:])
    print(f"delta sync: 49 partial versions, bytes vs whole {ratio:.4f}, fallbacks {reports[-1].fallbacks}")
    assert ratio < 0.1


def test_a_replica_that_missed_a_version_gets_it_whole_counted_and_an_old_client_updates_whole(
        model_dir, trainer_state):
    state = {name: tensor.clone() for name, tensor in trainer_state.items()}
    generator = torch.Generator().manual_seed(1)

    async def scenario(engines, addresses):
        reports = {}
        async with WeightBroadcaster(addresses, _config()) as broadcaster:
            await _publish_steps(broadcaster, state, generator, (1, 2), reports)
            broadcaster.set_receivers(addresses[:1])  # the second replica misses version 3
            _step(state, generator)
            reports[3] = await broadcaster.publish(state, 3)
            broadcaster.set_receivers(addresses)
            await _publish_steps(broadcaster, state, generator, (4, 5), reports)
            for engine in engines:
                _assert_serves(engine, state)
        # An old client: no base_version, no parts (what every trainer sent before delta sync): a whole update.
        _step(state, generator)
        async with WeightBroadcaster(addresses, _config(delta="off")) as old:
            reports[6] = await old.publish(state, 6)
        for engine in engines:
            _assert_serves(engine, state)
        return reports

    reports = _run(model_dir, 2, scenario)
    assert all(report.ok for report in reports.values()), {v: r.failed for v, r in reports.items()}
    assert [reports[v].partial for v in range(1, 7)] == [False, True, True, False, True, False]
    assert [reports[v].fallbacks for v in range(1, 6)] == [0, 0, 0, 1, 1]
    assert reports[4].bytes == reports[4].full_bytes and reports[6].bytes == reports[6].full_bytes
    assert reports[5].bytes < 0.1 * reports[5].full_bytes


def test_a_restarted_replica_answers_needs_full_and_gets_the_version_whole(model_dir, trainer_state):
    state = {name: tensor.clone() for name, tensor in trainer_state.items()}
    generator = torch.Generator().manual_seed(2)

    async def scenario(engines, addresses):
        reports = {}
        async with WeightBroadcaster(addresses, _config()) as broadcaster:
            await _publish_steps(broadcaster, state, generator, (1, 2), reports)
            # The replica restarts at the same address: its base weights at version 0, no buffers, no group.
            engine, server, address = served[0]
            await server.stop(0)
            engine.shutdown()
            served[0] = await _serve(model_dir, port=int(address.rsplit(":", 1)[1]))
            _step(state, generator)
            reports[3] = await broadcaster.publish(state, 3)
            _step(state, generator)
            reports[4] = await broadcaster.publish(state, 4)
            _assert_serves(served[0][0], state)
        return reports

    served = []

    async def main():
        served.append(await _serve(model_dir))
        try:
            return await scenario(None, [served[0][2]])
        finally:
            await served[0][1].stop(1)
            served[0][0].shutdown()

    reports = asyncio.run(main())
    assert all(report.ok for report in reports.values()), {v: r.failed for v, r in reports.items()}
    assert [reports[v].partial for v in range(1, 5)] == [False, True, False, True]
    assert [reports[v].fallbacks for v in range(1, 5)] == [0, 0, 1, 1]


class _CopyingEngine:
    """An engine that copies each update into its own tensors (as the native engine replaying CUDA graphs does):
    the receiver keeps one set of buffers, which a partial update patches in place."""

    adopts_weights = False
    device = torch.device("cpu")
    last_pause_s = 0.0

    def __init__(self, layout):
        self.weights = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype) in layout.items()}
        self.weight_version = 0

    def parameter_layout(self):
        return {name: (tuple(t.shape), t.dtype) for name, t in self.weights.items()}

    async def update_weights(self, weights, version, adopt=False):
        for name, tensor in weights.items():
            self.weights[name].copy_(tensor)
        self.weight_version = version
        return 0.0


def test_an_engine_that_copies_takes_partial_updates_on_its_one_set_of_buffers_and_a_mismatch_falls_back(monkeypatch):
    from rollout.serve import weight_receiver

    real, calls = weight_receiver.receive_parts, []

    def drifted_once(transfer, manifest, parts, deadline, staging, base, cancelled=None):
        calls.append(1)
        if len(calls) == 6:  # version 6: one word of the held base drifted: its checksum fails
            staging[0].view(torch.int16)[7] += 1
        real(transfer, manifest, parts, deadline, staging, base, cancelled)

    monkeypatch.setattr(weight_receiver, "receive_parts", drifted_once)
    generator = torch.Generator().manual_seed(4)
    state = {"a.weight": torch.randn(96, 64, generator=generator), "b.bias": torch.randn(333, generator=generator)}
    engine = _CopyingEngine({name: (tuple(t.shape), torch.bfloat16) for name, t in state.items()})

    async def main():
        receiver = WeightReceiver(engine)
        server, port = await create_server("127.0.0.1:0", [(weights_pb2_grpc.add_WeightSyncServicer_to_server,
                                                            receiver, "relayrl.weights.v1.WeightSync")])
        await server.start()
        try:
            async with WeightBroadcaster([f"127.0.0.1:{port}"], _config()) as broadcaster:
                reports = []
                for version in range(1, 11):
                    _step(state, generator, fraction=0.02)
                    reports.append(await broadcaster.publish(state, version))
            return reports
        finally:
            await server.stop(1)

    reports = asyncio.run(main())
    assert [r.ok for r in reports] == [True] * 5 + [False] + [True] * 4
    assert "checksum mismatch" in reports[5].failed[next(iter(reports[5].failed))]
    assert [r.partial for r in reports] == [False] + [True] * 5 + [False] + [True] * 3  # version 7 goes whole
    assert [r.fallbacks for r in reports] == [0] * 6 + [1] * 4
    for name, tensor in state.items():
        assert torch.equal(engine.weights[name], tensor.to(torch.bfloat16)), name


class _LocalTransfer:
    """A one-member 'group' that hands the receiver the sender's wire buckets in order."""

    device = torch.device("cpu")

    def __init__(self, wire):
        self.wire = list(wire)

    def broadcast(self, tensor):
        tensor.copy_(self.wire.pop(0))
        return self

    def wait(self, deadline):
        pass


def test_a_corrupted_delta_fails_its_checksum():
    manifest = Manifest((TensorSlot("w", (64,), torch.bfloat16, 0, 0),), (128,))
    base = torch.randn(64).to(torch.bfloat16)
    current = base.clone()
    current[3] += 1
    word = word_dtype(manifest, 0)
    part, wire = encode_bucket(0, current.view(torch.uint8), base.view(torch.uint8), word)
    assert part.encoding == DELTA and part.words == 1
    staging = [base.clone().view(torch.uint8)]
    receive_parts(_LocalTransfer([wire]), manifest, [part], 1e18, staging, None)
    assert torch.equal(staging[0], current.view(torch.uint8))
    staging = [base.clone().view(torch.uint8)]
    wire[-1] ^= 1  # one flipped bit in the new value
    with pytest.raises(ChecksumMismatch):
        receive_parts(_LocalTransfer([wire]), manifest, [part], 1e18, staging, None)
    assert encode_bucket(0, current.view(torch.uint8), None, word)[0].encoding == WHOLE


def test_the_trainers_publisher_reports_delta_bytes_and_fallbacks_against_a_restarted_rollout_process(
        tiny_model_dir, service_factory):
    """RolloutPublisher (the trainer's) with publish.delta auto, to a real rollout worker process: the second version
    goes partial; after the worker restarts (version 0, no base) the next goes whole, counted in delta_fallbacks."""
    from transformers import AutoModelForCausalLM

    from trainer.config.publish import PublishConfig
    from trainer.run import RolloutPublisher

    rollout = service_factory("rollout", {"model": str(tiny_model_dir)})
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    generator = torch.Generator().manual_seed(3)
    publisher = RolloutPublisher(PublishConfig(receivers=[rollout.address], timeout_s=30, delta="auto"))
    timings = []
    try:
        for version in (1, 2, 3, 4):
            if version == 3:
                rollout.restart()
            _step(state, generator)
            assert publisher(state, version) == version
            timings.append(publisher.timings)
    finally:
        publisher.close()
    assert [t["delta_fallbacks"] for t in timings] == [0, 0, 1, 1]
    assert [t["publish_bytes_ratio"] == 1.0 for t in timings] == [True, False, True, False]
    assert timings[1]["publish_bytes_ratio"] < 0.1 and timings[3]["publish_bytes_ratio"] < 0.1
