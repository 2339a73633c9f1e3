"""Pipeline stages publish their own layers (trainer/broadcast/senders.py): under torchrun, 2 gloo ranks with pp=2,
each stage's rank sends its buckets on a group of its own to the receivers, which commit the version only once both
parts have arrived: a native engine inside rank 0 (its parameters compared bit for bit with the trainer's) and a real
rollout service process (every bucket's checksum verified on arrival; its greedy tokens compared with the trainer's
model's). A stage whose part never arrives fails its version at both receivers with an error naming that stage; they
keep serving the version before, and the next publish lands; so does an overlapped one (`publish.overlap`).

`StagePublisher` is the trainer's own publish path (policy_weights, stage_senders, Publishing, RolloutPublisher);
test_trainer_pipeline.py publishes its trained policies through it too. This file runs as the torchrun script of
its own test (see `worker`).
"""

import argparse
import asyncio
import sys
import threading
from pathlib import Path

import pytest
import torch

from trainer.broadcast.senders import StageSender
from trainer.checkpoint import TrainState

PROMPT = [1, *range(10, 26)]
GREEDY_TOKENS = 12


class InProcessEngine:
    """A native engine behind its WeightSync server, on an event loop of its own thread (in rank 0)."""

    def __init__(self, model: str):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="test-engine", daemon=True).start()
        self.engine, self.server, port = self._run(self._start(model))
        self.address = f"127.0.0.1:{port}"

    async def _start(self, model: str):
        from protos import weights_pb2_grpc
        from rollout.config import EngineConfig
        from rollout.engine.async_engine import AsyncEngine
        from rollout.engine.llm_engine import LLMEngine
        from rollout.serve.weight_receiver import WeightReceiver
        from services.server import create_server

        engine = AsyncEngine(LLMEngine(EngineConfig(model=model, num_blocks=32, max_num_seqs=2, max_n=1)))
        registration = (weights_pb2_grpc.add_WeightSyncServicer_to_server, WeightReceiver(engine),
                        "relayrl.weights.v1.WeightSync")
        server, port = await create_server("127.0.0.1:0", [registration])
        await server.start()
        return engine, server, port

    def parameters(self) -> dict[str, torch.Tensor]:
        return {name: t.detach().clone() for name, t in self.engine.engine.runner.model.named_parameters()}

    def close(self) -> None:
        self._run(self.server.stop(1))
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(120)


class StagePublisher:
    """The trainer's publish path with pipeline stages, as trainer/loop.py wires it: every stage's first rank sends
    its own layers; rank 0's RolloutPublisher publishes to an in-process engine and to `engines` (addresses of real
    rollout processes). Collective: every rank makes one and calls `publish` together."""

    def __init__(self, model: str, learner, env, engines: list[str], timeout_s: float):
        from trainer.config.publish import PublishConfig
        from trainer.publishing import Publishing, policy_weights, stage_senders
        from trainer.run import RolloutPublisher

        self.learner, self.env = learner, env
        self.local = InProcessEngine(model) if env.is_main else None
        receivers = [self.local.address, *engines] if env.is_main else []
        config = PublishConfig(receivers=receivers, timeout_s=timeout_s, control_timeout_s=10.0)
        self.publisher = RolloutPublisher(config) if env.is_main else None
        self.follower = stage_senders(env, self.publisher, config)
        weights = policy_weights(learner, env, self.publisher, config)
        self.publishing, self.overlapped = (
            Publishing(weights, self.publisher, overlap, env, timeout_s + 60.0, None, self.follower)
            for overlap in (False, True))

    def publish(self, version: int, dead_stage: bool = False, overlap: bool = False) -> dict | None:
        """Publish the policy as `version` (with `dead_stage`, stage 1 takes its round and sends nothing: its part
        never arrives; with `overlap`, on a thread of each sender, as `publish.overlap` runs it, waited for at once);
        on rank 0: the report, what every receiver serves then, the in-process engine's parameters and the trainer's
        weights (Hugging Face names)."""
        from trainer.checkpoint import hf_state_dict
        from trainer.parallel import gather_model_state

        if dead_stage and self.follower is not None:
            self.publishing.follower = DeadStage(self.follower.group)
        if overlap:
            state = TrainState(weight_version=version)
            self.overlapped(state)
            self.overlapped.finish(state)
        else:
            self.publishing(TrainState(weight_version=version))
        self.publishing.follower = self.follower
        trainer = hf_state_dict(gather_model_state(self.learner.policy, self.env), tied_embeddings=False)
        if not self.env.is_main:
            return None
        report = self.publisher.last_report
        served_versions = {**self.publisher.served_versions(), self.local.address: self.local.engine.weight_version}
        return {"ok": report.ok, "failed": report.failed, "served_versions": served_versions,
                "local": self.local.address, "served": self.local.parameters(), "trainer": trainer}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.publishing.finish(TrainState())
        if self.env.is_main:
            self.publisher.close()
            self.local.close()


class DeadStage(StageSender):
    """A stage that takes its round and dies before it sends: its part never arrives."""

    def send(self, assignment, part, packed) -> None:
        pass


def differing(served: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> list[str]:
    """The names whose served tensor is not bit for bit the trainer's (every served name must be published)."""
    return sorted(name for name, tensor in served.items() if not torch.equal(tensor, weights[name]))


def greedy(model_dir: Path, weights: dict[str, torch.Tensor]) -> list[int]:
    """transformers' greedy continuation of PROMPT with `weights` loaded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.load_state_dict(weights)
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(GREEDY_TOKENS):
            tokens.append(int(model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(PROMPT):]


def engine_greedy(address: str) -> tuple[list[int], int]:
    """A rollout service's greedy continuation of PROMPT, and the weight version it served it with."""
    from protos import rollout_pb2, rollout_pb2_grpc
    from protos.codec import decode_array, encode_array
    from services.client import connect_sync

    request = rollout_pb2.GenerateRequest(
        prompt_ids=encode_array(PROMPT, "int32"),
        params=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True))
    with connect_sync(address) as channel:
        completion = rollout_pb2_grpc.RolloutStub(channel).Generate(request, timeout=60).completions[0]
    versions = decode_array(completion.weight_versions, expect="int64")
    return decode_array(completion.token_ids, expect="int32").tolist(), int(versions[-1])


def _move(learner) -> None:
    """Each stage moves its own layers: what the next version carries."""
    with torch.no_grad():
        for parameter in learner.policy.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))


def worker(args) -> None:
    """Under torchrun (2 ranks, pp 2): version 1 from both stages; every stage's layers moved; version 2 with stage
    1 dead; version 3 from both stages again; version 4 overlapped (each sender's part sent from a thread)."""
    torch.set_num_threads(1)
    from test_trainer_pipeline import _config

    from trainer.learner import Learner
    from trainer.parallel import init_distributed, shutdown_distributed

    env = init_distributed("cpu", pp=2)
    learner = Learner(_config(args.model, {"name": "grpo"}, 2, "1f1b", 2), env)
    results = {}
    with StagePublisher(args.model, learner, env, [args.engine], timeout_s=args.timeout_s) as publisher:
        results[1] = publisher.publish(1)
        _move(learner)
        results[2] = publisher.publish(2, dead_stage=True)
        results[3] = publisher.publish(3)
        _move(learner)
        results[4] = publisher.publish(4, overlap=True)
    if env.is_main:
        torch.save(results, args.out)
    env.barrier()
    shutdown_distributed(env)


@pytest.fixture(scope="module")
def two_stage_model(tmp_path_factory) -> Path:
    from rollout.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("pp-publish") / "qwen2", num_layers=4, hidden_size=64,
                            num_heads=2, num_kv_heads=1, intermediate_size=96, seed=0)


@pytest.mark.slow
def test_a_stage_whose_part_never_arrives_fails_the_version_and_the_next_lands(two_stage_model, tmp_path, free_port,
                                                                                service_factory):
    from test_trainer_parallel import _run

    engine = service_factory("rollout", {"model": str(two_stage_model)})
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port)]
    _run([*torchrun, str(Path(__file__)), "--model", str(two_stage_model), "--engine", engine.address,
          "--out", str(tmp_path / "out.pt"), "--timeout-s", "8"], tmp_path, timeout=300)
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    first, dead, last = results[1], results[2], results[3]
    receivers = {first["local"], engine.address}
    assert first["ok"] and first["served_versions"] == dict.fromkeys(receivers, 1), first["failed"]
    assert len(first["served"]) > 40 and differing(first["served"], first["trainer"]) == []
    # Stage 1 never sent: both receivers fail version 2 naming it, and serve version 1's weights still.
    assert not dead["ok"] and set(dead["failed"]) == receivers
    for error in dead["failed"].values():
        assert "the part of sender 1" in error and "did not all arrive" in error and "still serving version 1" in error
    assert dead["served_versions"] == dict.fromkeys(receivers, 1)
    assert differing(dead["served"], first["trainer"]) == []
    assert differing(dead["served"], dead["trainer"]) != []  # version 2's weights differ: the test can fail
    # The next publish forms new groups with both stages and lands bit for bit.
    assert last["ok"] and last["served_versions"] == dict.fromkeys(receivers, 3), last["failed"]
    assert differing(last["served"], last["trainer"]) == []
    # Overlapped (each sender's part sent from a thread of its own): it lands too, and the real engine's greedy tokens
    # are then the trainer's model's.
    overlapped = results[4]
    assert overlapped["ok"] and overlapped["served_versions"] == dict.fromkeys(receivers, 4), overlapped["failed"]
    assert differing(overlapped["served"], overlapped["trainer"]) == []
    assert differing(overlapped["served"], last["trainer"]) != []
    tokens, version = engine_greedy(engine.address)
    assert version == 4 and tokens == greedy(two_stage_model, overlapped["trainer"])


@pytest.mark.slow
def test_the_training_loop_publishes_from_both_stages(two_stage_model, tmp_path, free_port, service_factory):
    """`python -m trainer` under torchrun with parallel.pp 2 (trainer/loop.py wires stage_senders): 2 steps, each
    version published by both stages to a rollout process, which then serves the exported model's greedy tokens."""
    from test_trainer_loop import BATCH, make_samples, put, records, stats, trainer_overrides
    from test_trainer_parallel import _run

    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    engine = service_factory("rollout", {"model": str(two_stage_model)})
    put(buffer.address, make_samples(3 * BATCH))
    overrides = trainer_overrides(two_stage_model, buffer.address, tmp_path, 2, **{
        "parallel.pp": "2", "batch.micro_batch_size": "2", "publish.receivers": f"[{engine.address}]",
        "publish.timeout_s": "30", "metrics_path": str(tmp_path / "metrics.jsonl"),
        "checkpoint.export_dir": str(tmp_path / "export")})
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port)]
    _run([*torchrun, "-m", "trainer", *overrides], tmp_path, timeout=300)
    assert [r["step"] for r in records(tmp_path / "metrics.jsonl")] == [1, 2]
    assert stats(buffer.address).trainer_version == 2
    from safetensors.torch import load_file

    exported = {}
    for path in sorted((tmp_path / "export").glob("*.safetensors")):
        exported.update(load_file(path))
    tokens, version = engine_greedy(engine.address)
    assert version == 2 and tokens == greedy(two_stage_model, exported)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout-s", type=float, default=8.0)
    worker(parser.parse_args())
