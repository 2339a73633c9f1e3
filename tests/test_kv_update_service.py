"""kv_version end to end: a rollout process (engine.kv_on_update keep or recompute) and a buffer process; a session
whose weights are updated between two turns by a real publish (WeightBroadcaster over gloo). The second turn's
last chunk, the sample CloseSession returns and the sample the buffer hands out carry the oldest weight version of
the KV the episode's tokens were sampled on: the first turn's with keep, the new one with recompute. And the
driver's samples carry their completions' kv_version."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from deploy.experiment.tasks import arithmetic_tasks, write_jsonl
from protos import buffer_pb2, buffer_pb2_grpc, common_pb2, reward_pb2, rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_array, encode_array
from protos.sample import Sample
from rollout.driver.driver import Driver, DriverConfig, load_prompts
from services.client import connect
from trainer.broadcast.broadcaster import WeightBroadcaster
from trainer.broadcast.config import BroadcastConfig

torch.set_num_threads(1)
PROMPT = [1, *range(40, 52)]
OBSERVATION = [60, 61, 62, 63]


@pytest.fixture(scope="module")
def buffer(tmp_path_factory):
    from deploy.local.service_process import start_service

    service = start_service("buffer", {"data_dir": str(tmp_path_factory.mktemp("buffer")), "max_staleness": 4},
                            log_dir=tmp_path_factory.mktemp("buffer-logs"))
    yield service
    service.stop(timeout=10)


@pytest.fixture(scope="module")
def new_weights(tiny_model_dir) -> dict[str, torch.Tensor]:
    """The tiny model's tensors after a training step, as the trainer publishes them."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    return {name: t + torch.randn(t.shape, generator=gen) * 0.05 for name, t in model.state_dict().items()}


async def turn(stub, session_id: str, whole: bool) -> rollout_pb2.GenerateChunk:
    """The turn's last chunk; the chunks before it carry no kv_version."""
    chunks = [chunk async for chunk in stub.GenerateInSession(rollout_pb2.GenerateInSessionRequest(
        session_id=session_id, whole_turn=whole,
        params=rollout_pb2.SamplingParams(temperature=0.8, max_tokens=6, seed=3, ignore_eos=True, logprobs=True)))]
    assert chunks[-1].finish_reason == rollout_pb2.FINISH_REASON_LENGTH and (len(chunks) == 1 or not whole)
    assert not any(chunk.HasField("kv_version") for chunk in chunks[:-1])
    return chunks[-1]


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_the_sample_in_the_buffer_carries_the_kv_version_of_its_episode(mode, tiny_model_dir, buffer, new_weights,
                                                                        service_factory):
    rollout = service_factory("rollout", {"model": str(tiny_model_dir), "engine.max_model_len": 128,
                                          "engine.torch_threads": 1, "engine.kv_on_update": mode,
                                          "buffer": buffer.address})

    async def episode():
        async with connect(rollout.address) as channel, connect(buffer.address) as buffer_channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            version = (await stub.GetWeightVersion(rollout_pb2.GetWeightVersionRequest())).version
            await stub.OpenSession(rollout_pb2.OpenSessionRequest(session_id=mode, prompt_ids=encode_array(PROMPT,
                                                                                                        "int32")))
            first = await turn(stub, mode, whole=False)
            await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
                session_id=mode, token_ids=encode_array(OBSERVATION, "int32")))
            async with WeightBroadcaster([rollout.address], BroadcastConfig(timeout_s=30)) as broadcaster:
                report = await broadcaster.publish(new_weights, version + 1)
            assert report.ok, report.failed
            second = await turn(stub, mode, whole=True)
            generated = await stub.Generate(rollout_pb2.GenerateRequest(
                prompt_ids=encode_array(PROMPT, "int32"), params=rollout_pb2.SamplingParams(max_tokens=3)))
            closed = await stub.CloseSession(rollout_pb2.CloseSessionRequest(
                session_id=mode, submit=True, sample_id=f"kv-{mode}", group_id=f"kv-{mode}", group_size=1))
            buffer_stub = buffer_pb2_grpc.BufferStub(buffer_channel)
            pulled = []
            async for batch in buffer_stub.Pull(buffer_pb2.PullRequest(batch_size=1, max_batches=1), timeout=10):
                pulled += batch.samples
                await buffer_stub.Ack(buffer_pb2.AckRequest(lease_id=batch.lease_id), timeout=5)  # not re-delivered
            return version, first, second, generated, closed, pulled

    version, first, second, generated, closed, pulled = asyncio.run(episode())
    assert first.HasField("kv_version") and first.kv_version == version
    assert set(decode_array(second.weight_versions).tolist()) == {version + 1}
    expected = version if mode == "keep" else version + 1
    assert second.HasField("kv_version") and second.kv_version == expected
    assert generated.completions[0].HasField("kv_version") and generated.completions[0].kv_version == version + 1  # a new request: prefilled with the new weights
    assert closed.submitted and closed.stats.kv_recomputes == (mode == "recompute")
    assert Sample.from_proto(closed.sample).kv_version == expected
    [stored] = pulled
    assert stored.sample_id == f"kv-{mode}" and Sample.from_proto(stored).kv_version == expected


async def test_the_driver_puts_each_completions_kv_version_into_its_sample(tmp_path, tiny_model_dir):
    """The driver's group over stand-ins for the rollout, reward and buffer calls (their services: above and in
    tests/test_quickstart_e2e.py): a completion's kv_version becomes its sample's; one without stays unknown."""
    cfg = DriverConfig.model_validate({
        "rollout": "127.0.0.1:1", "reward": "127.0.0.1:2", "buffer": "127.0.0.1:3", "tokenizer": str(tiny_model_dir),
        "prompts": str(write_jsonl(arithmetic_tasks(digits=1)[:1], tmp_path / "prompts.jsonl")), "group_size": 2})
    driver = Driver(cfg)
    stored: list[common_pb2.Sample] = []

    def completion(index: int, **kv_version) -> rollout_pb2.Completion:
        return rollout_pb2.Completion(index=index, token_ids=encode_array([5, 6], "int32"),
                                      logprobs=encode_array([-1.0, -2.0], "float32"),
                                      weight_versions=encode_array([3, 4], "int64"),
                                      finish_reason=rollout_pb2.FINISH_REASON_LENGTH, **kv_version)

    async def generate(requests):
        return [rollout_pb2.GenerateResponse(completions=[completion(0, kv_version=3), completion(1)])]

    async def score(protos):
        return [reward_pb2.ScoreResult(reward=1.0, status=common_pb2.SAMPLE_STATUS_COMPLETED) for _ in protos]

    async def put(protos):
        stored.extend(protos)
        return [None] * len(protos)

    driver.generator.submit, driver.scorer.submit, driver.storer.submit = generate, score, put
    try:
        await driver.run_group(load_prompts(cfg)[0], 0)
    finally:
        await driver.close()
    assert [Sample.from_proto(proto).kv_version for proto in stored] == [3, None]
