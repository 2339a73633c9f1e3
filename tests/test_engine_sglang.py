"""The SGLang engine behind the engine interface (rollout/engines/sglang_engine.py), against the native engine.

GPU only (SGLang's kernels are CUDA's): marked gpu, skipped without CUDA or without sglang (`pip install -e
'.[sglang]'` on the GPU machine). Both engines run the same float32 checkpoint on the GPU. Not run yet: the
machines this was written on have no GPU.
"""

import asyncio

import pytest
import torch

pytestmark = pytest.mark.gpu
sglang = pytest.importorskip("sglang")

from rollout.config import EngineConfig
from rollout.engine.async_engine import AsyncEngine
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.engines.settings import SglangSettings
from rollout.engines.sglang_engine import SglangEngine
from rollout.serve.weight_receiver import WeightReceiver
from trainer.broadcast.broadcaster import WeightBroadcaster
from trainer.broadcast.config import BroadcastConfig

PROMPTS = [[5, 17, 33, 2, 60], [70, 71, 72], [9] * 12]


def _new_weights(model_dir, seed: int) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model.state_dict()


def test_sglang_after_a_weight_update_matches_the_native_engine(sharp_model_dir):
    """After one update through the adapter both engines give the same greedy tokens, logprobs within 1e-3
    (different GPU kernels), every token at version 1; abort ends a request with its partial output."""
    state = _new_weights(sharp_model_dir, seed=1)

    async def main():
        native = AsyncEngine(LLMEngine(EngineConfig(model=str(sharp_model_dir), device="cuda", dtype="float32", max_model_len=128)))
        engine = SglangEngine(str(sharp_model_dir), SglangSettings(type="sglang", dtype="float32", max_model_len=128,
                                                                   mem_fraction_static=0.3))
        try:
            assert engine.parameter_layout().keys() == native.parameter_layout().keys()
            cuda_state = {name: t.cuda() for name, t in state.items()}
            await native.update_weights(cuda_state, 1)
            await engine.update_weights(cuda_state, 1)
            greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            for i, prompt in enumerate(PROMPTS):
                [mine] = await native.generate_all(f"n{i}", prompt, greedy)
                [other] = await engine.generate_all(f"s{i}", prompt, greedy)
                assert other.token_ids == mine.token_ids
                assert max(abs(a - b) for a, b in zip(mine.logprobs, other.logprobs)) < 1e-3
                assert set(other.weight_versions) == {1}
            scored, version = await engine.compute_logprobs(PROMPTS[0], [mine.token_ids], 1.0)
            expected, _ = await native.compute_logprobs(PROMPTS[0], [mine.token_ids], 1.0)
            assert version == 1 and max(abs(a - b) for a, b in zip(scored[0], expected[0])) < 1e-3

            long = SamplingParams(temperature=1.0, max_tokens=100, ignore_eos=True, seed=3)
            task = asyncio.ensure_future(engine.generate_all("long", PROMPTS[1], long))
            await asyncio.sleep(0.05)
            assert await engine.abort("long")
            [aborted] = await task
            assert aborted.finish_reason.value == "abort" and len(aborted.token_ids) < 100
        finally:
            engine.shutdown()
            native.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_sglang_receives_a_publish_through_its_distributed_update_api(sharp_model_dir, backend):
    """A real trainer-side WeightBroadcaster publishes to the rollout service's WeightReceiver over SGLang:
    SGLang's scheduler joins the trainer's group (init_weights_update_group) and receives every tensor
    (update_weights_from_distributed); its greedy tokens and logprobs then equal the native engine's with the
    same weights (within 1e-3), every token at the published version. gloo: the trainer's tensors on the CPU,
    one GPU; nccl: the trainer on a second GPU. A second publish reuses the group."""
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs the trainer and SGLang on GPUs of their own")
    from protos import weights_pb2_grpc
    from services.server import create_server

    async def main():
        native = AsyncEngine(LLMEngine(EngineConfig(model=str(sharp_model_dir), device="cuda", dtype="float32", max_model_len=128)))
        engine = SglangEngine(str(sharp_model_dir), SglangSettings(type="sglang", dtype="float32", max_model_len=128,
                                                                   mem_fraction_static=0.3))
        server, port = await create_server("127.0.0.1:0", [(weights_pb2_grpc.add_WeightSyncServicer_to_server,
                                                            WeightReceiver(engine), "relayrl.weights.v1.WeightSync")])
        await server.start()
        trainer_device = "cuda:1" if backend == "nccl" else "cpu"
        broadcaster = WeightBroadcaster([f"127.0.0.1:{port}"], BroadcastConfig(backend=backend, timeout_s=120),
                                        device=trainer_device if backend == "nccl" else None)
        try:
            greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            for version in (1, 2):
                state = _new_weights(sharp_model_dir, seed=version)
                report = await broadcaster.publish({n: t.to(trainer_device) for n, t in state.items()}, version)
                assert report.ok, report.failed
                assert report.group_reused == (version == 2)
                await native.update_weights({n: t.cuda() for n, t in state.items()}, version)
                for i, prompt in enumerate(PROMPTS):
                    [mine] = await native.generate_all(f"n{version}-{i}", prompt, greedy)
                    [other] = await engine.generate_all(f"s{version}-{i}", prompt, greedy)
                    assert other.token_ids == mine.token_ids
                    assert max(abs(a - b) for a, b in zip(mine.logprobs, other.logprobs)) < 1e-3
                    assert set(other.weight_versions) == {version}
        finally:
            await broadcaster.close()
            await server.stop(5)
            engine.shutdown()
            native.shutdown()

    asyncio.run(main())


def test_sglang_serves_adapter_versions_loaded_from_tensors_each_request_on_its_own(sharp_model_dir):
    """lora.mode unmerged: adapter versions 1 and 2 reach SGLang through load_lora_adapter_from_tensors; a greedy
    request that started on version 1 while version 2 arrived finishes on it (tokens of the native engine's version 1,
    every one tagged 1), a later one runs on version 2; SGLang no longer joins the trainer's group itself."""
    from transformers import AutoModelForCausalLM

    from rollout.engines.lora_versions import LORA_MODULES

    model = AutoModelForCausalLM.from_pretrained(sharp_model_dir, dtype=torch.float32)

    def adapters(seed: int) -> dict[str, torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        out = {}
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LORA_MODULES:
                rows, cols = module.weight.shape
                out[f"{name}.lora_A.weight"] = torch.randn(4, cols, generator=generator) * 0.2
                out[f"{name}.lora_B.weight"] = torch.randn(rows, 4, generator=generator) * 0.2
        return out

    a1, a2 = adapters(1), adapters(2)
    greedy = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def main():
        native = AsyncEngine(LLMEngine(EngineConfig(model=str(sharp_model_dir), device="cuda", dtype="float32",
                                                    max_model_len=128, lora={"mode": "unmerged"})))
        engine = SglangEngine(str(sharp_model_dir), SglangSettings(
            type="sglang", dtype="float32", max_model_len=128, mem_fraction_static=0.3,
            lora={"mode": "unmerged", "max_rank": 8}))
        try:
            assert not engine.receives_from_group and engine.serves_adapters_unmerged
            await engine.update_weights(a1, 1)
            await native.update_weights(a1, 1)
            [expected_v1] = await native.generate_all("n1", PROMPTS[0], greedy)
            running = asyncio.ensure_future(engine.generate_all("pinned", PROMPTS[0], greedy))
            while engine.stats["running"] == 0:
                await asyncio.sleep(0.01)
            await engine.update_weights(a2, 2)
            [pinned] = await running
            assert set(pinned.weight_versions) == {1}
            assert pinned.token_ids == expected_v1.token_ids
            await native.update_weights(a2, 2)
            [expected_v2] = await native.generate_all("n2", PROMPTS[0], greedy)
            [after] = await engine.generate_all("after", PROMPTS[0], greedy)
            assert set(after.weight_versions) == {2} and after.token_ids == expected_v2.token_ids
        finally:
            engine.shutdown()
            native.shutdown()

    asyncio.run(main())
