"""Adapter-only publish (a LoRA policy: trainer/adapter_publish.py, trainer/broadcast/adapter.py) to a real rollout
service process: the base goes once, then each version is the adapter alone (a partial update on the last version),
served unmerged (a resident adapter version, W untouched: rollout/model/lora.py) or merged by the receiver (W + B @ A,
rollout/serve/adapter_merge.py), and the engine's greedy tokens equal transformers' with the adapter. A step that did not move the adapter publishes nothing (Publishing's gate), decided by all ranks
together (the torchrun test runs this file as a script on 2 gloo ranks)."""

import argparse
import asyncio
import json
import sys
from pathlib import Path

import pytest
import torch

from protos import rollout_pb2, rollout_pb2_grpc
from protos.codec import CodecError, decode_array, encode_array
from services.client import connect_sync
from services.weights import plan_buckets
from trainer.broadcast.broadcaster import WeightBroadcaster
from trainer.broadcast.config import BroadcastConfig

torch.set_num_threads(1)
PROMPT = [1, *range(10, 30)]
MAX_TOKENS = 12
LORA = {"rank": 4, "alpha": 8.0, "target_modules": "all-linear"}


def lora_policy(model_dir):
    from trainer.config.model import ModelConfig
    from trainer.parallel import DistEnv, build_policy

    return build_policy(model_dir, DistEnv(0, 1, torch.device("cpu")), None, ModelConfig(lora=LORA))


def move_adapters(policy, seed: int, scale: float = 0.3) -> None:
    """What some optimizer steps do to the adapters (B starts at zero: the first move makes the adapter matter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in policy.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)


def greedy_with_transformers(policy) -> list[int]:
    """Greedy tokens of the policy's language model, adapters on (full forward per token)."""
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            ids.append(int(policy.lm(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


def greedy_from_rollout(address: str) -> tuple[list[int], int]:
    request = rollout_pb2.GenerateRequest(
        prompt_ids=encode_array(PROMPT, "int32"),
        params=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    with connect_sync(address) as channel:
        reply = rollout_pb2_grpc.RolloutStub(channel).Generate(request, timeout=60)
    completion = reply.completions[0]
    versions = decode_array(completion.weight_versions, expect="int64")
    return decode_array(completion.token_ids, expect="int32").tolist(), int(versions[-1])


def publish_adapter_versions(address: str, policy, weights, versions: int) -> tuple[list, list]:
    """Versions 1..`versions` of `policy`'s adapters (each moved by its seed) published to the rollout at `address`:
    each publish's report, and each version's (greedy tokens from the rollout, its version tag) with transformers'."""

    async def publish():
        reports, served = [], []
        async with WeightBroadcaster([address], BroadcastConfig(adapter=True, bucket_mb=0.25)) as broadcaster:
            for version in range(1, versions + 1):
                move_adapters(policy, seed=version)
                reports.append(await broadcaster.publish(weights(), version))
                assert reports[-1].ok, reports[-1].failed
                served.append((await asyncio.to_thread(greedy_from_rollout, address), greedy_with_transformers(policy)))
        return reports, served

    return asyncio.run(publish())


@pytest.fixture(scope="module", params=["unmerged", pytest.param("merged", marks=pytest.mark.slow)])
def rollout(request, sharp_model_dir, tmp_path_factory):
    from deploy.local.service_process import start_service

    service = start_service("rollout", {"model": str(sharp_model_dir), "engine": {"lora": {"mode": request.param}},
                                        "server.metrics_port": 0},
                            log_dir=tmp_path_factory.mktemp("logs"))
    yield service
    service.stop(timeout=10)


def test_the_base_goes_once_then_the_adapter_alone_and_the_engine_serves_it(rollout, sharp_model_dir, request):
    from trainer.adapter_publish import AdapterWeights
    from trainer.parallel import DistEnv

    policy = lora_policy(sharp_model_dir)
    weights = AdapterWeights(policy, DistEnv(0, 1, torch.device("cpu")), None)
    base_tokens = greedy_with_transformers(policy)  # B = 0: the adapter is a no-op

    reports, served = publish_adapter_versions(rollout.address, policy, weights, versions=4)
    for version, ((tokens, tagged), expected) in enumerate(served, start=1):
        assert tagged == version and tokens == expected, version
    assert any(expected != base_tokens for _, expected in served)  # the adapter changes what is generated
    adapter_bytes = sum(t.numel() * t.element_size() for name, t in weights().items() if "lora_" in name)
    assert not reports[0].partial and reports[0].bytes == reports[0].full_bytes
    for report in reports[1:]:
        assert report.partial and report.fallbacks == 0
        assert adapter_bytes <= report.bytes < 1.01 * adapter_bytes  # the adapter alone (and its alignment)
    import urllib.request

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{rollout.metrics_port}/metrics", timeout=10).read()
    # unmerged: the newest two adapter versions resident (engine.lora.versions_resident's default); merged: none
    resident = 2 if "unmerged" in request.node.callspec.id else 0
    assert f"relayrl_rollout_lora_versions_resident {resident}.0".encode() in metrics
    print(f"adapter publish: whole {reports[0].bytes} bytes, then {[r.bytes for r in reports[1:]]} "
          f"(adapter {adapter_bytes} bytes)")


def test_an_adapter_that_does_not_fit_its_weight_is_refused():
    from rollout.serve.weight_layout import check_layout

    layout = {"m.q.weight": ((8, 6), torch.float32), "m.q.bias": ((8,), torch.float32)}
    fits = {"m.q.weight": torch.zeros(8, 6), "m.q.bias": torch.zeros(8), "m.q.lora_A.weight": torch.zeros(2, 6),
            "m.q.lora_B.weight": torch.zeros(8, 2)}
    check_layout(plan_buckets(fits, 1 << 20), layout, adapters=True)
    with pytest.raises(CodecError, match="no such parameter, and this worker takes no LoRA adapters.*unmerged"):
        check_layout(plan_buckets(fits, 1 << 20), layout)  # not where adapters are not merged (SGLang receiving)
    for bad, match in (({"m.q.lora_A.weight": torch.zeros(2, 5)}, "do not fit"),
                       ({"m.q.lora_B.weight": torch.zeros(8, 3)}, "do not fit"),
                       ({"m.k.lora_A.weight": torch.zeros(2, 6)}, "no matrix parameter")):
        with pytest.raises(CodecError, match=match):
            check_layout(plan_buckets({**fits, **bad}, 1 << 20), layout, adapters=True)
    lone = {name: t for name, t in fits.items() if "lora_B" not in name}
    with pytest.raises(CodecError, match="both lora_A and lora_B"):
        check_layout(plan_buckets(lone, 1 << 20), layout, adapters=True)


def gate_run(model_dir: str, env, moves: list[bool]) -> dict:
    """Publish after each of `moves`' steps (True: this rank's adapter moved); what went out."""
    from trainer.adapter_publish import AdapterWeights
    from trainer.checkpoint import TrainState
    from trainer.config.model import ModelConfig
    from trainer.config.parallel import ParallelConfig
    from trainer.parallel import build_policy
    from trainer.publishing import Publishing

    policy = build_policy(model_dir, env, ParallelConfig(), ModelConfig(lora=LORA))
    sent = []

    def publish(tensors, version):
        sent.append((version, sorted(name for name in tensors if "lora_" in name)[:1]))
        return version

    from trainer.adapter_publish import AdapterGate

    publisher = Publishing(AdapterWeights(policy, env, None), publish if env.is_main else None, False, env, 60.0,
                           AdapterGate(policy, env, 1e-6).moved)
    state, versions = TrainState(), []
    publisher(state)  # the first publish: the base and the initial adapter
    for step, move in enumerate(moves):
        if move:
            with torch.no_grad():
                for name, parameter in policy.named_parameters():
                    if name.endswith("lora_B.weight"):
                        local = parameter.to_local() if hasattr(parameter, "to_local") else parameter
                        local.add_(1e-3 * (step + 1))
        state.weight_version += 1  # the loop's step
        publisher(state)
        versions.append(state.weight_version)
    return {"sent": [version for version, _ in sent], "versions": versions, "skipped": publisher.skipped}


def test_only_steps_that_moved_the_adapter_publish(tiny_model_dir):
    from trainer.parallel import DistEnv

    moves = [True, False, False, True, False, True]
    result = gate_run(str(tiny_model_dir), DistEnv(0, 1, torch.device("cpu")), moves)
    assert len(result["sent"]) == 1 + sum(moves) and result["skipped"] == moves.count(False)
    # A skipped step's version is the last published one: the same weights, so the rollout is not behind.
    assert result["versions"] == [1, 1, 1, 2, 2, 3] and result["sent"] == [0, 1, 2, 3]


@pytest.mark.ranks
def test_ranks_decide_together_when_one_ranks_adapter_moved(tiny_model_dir, tmp_path, free_port):
    from test_trainer_parallel import _run

    out = tmp_path / "gate.json"
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
          "--master_port", str(free_port), str(Path(__file__)), "--model", str(tiny_model_dir), "--out", str(out)],
         tmp_path)
    result = json.loads(out.read_text())
    assert result["sent"] == [0, 1, 2] and result["versions"] == [1, 1, 2] and result["skipped"] == 1


def worker(model: str, out: str) -> None:
    from trainer.parallel import init_distributed, shutdown_distributed

    env = init_distributed("cpu")
    # Only rank 1's shards move at the first and third steps: rank 0 alone would skip, and wait forever in the
    # publish's gathers that rank 1 started.
    result = gate_run(model, env, [env.rank == 1, False, env.rank == 1])
    if env.is_main:
        Path(out).write_text(json.dumps(result))
    shutdown_distributed(env)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker(args.model, args.out)
