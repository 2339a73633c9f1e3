"""An image through real rollout, reward and buffer processes into the learner: a driver reads image prompts
(base64 in the prompt file), the rollout (a tiny Qwen2.5-VL) expands and sees them, the reward scores, the buffer
stores the samples with their images, and a GRPO step of the learner on the pulled batch starts on-policy (ratio 1:
the trainer's logprobs of the sampled tokens equal the rollout engine's)."""

import asyncio
import base64
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from test_trainer_step import config as trainer_config
from test_trainer_step import local

from protos import buffer_pb2, buffer_pb2_grpc
from protos.codec import decode_array
from protos.sample import Sample
from rollout.driver.driver import Driver, DriverConfig, load_prompts
from rollout.model.tiny import write_tiny_model
from services.client import connect
from trainer.learner import Learner

IMAGE_PAD = 103  # the kit's image token (rollout/model/tiny_vlm.py)


def png(seed: int, size) -> str:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


@pytest.mark.ranks
def test_image_samples_flow_from_the_driver_to_a_learner_step(tmp_path, service_factory):
    model = write_tiny_model(tmp_path / "vlm", arch="qwen2_5_vl", seed=3)
    rollout = service_factory("rollout", {"model": str(model), "engine.torch_threads": 1, "engine.max_model_len": 96,
                                          "engine.dtype": "float32"})
    reward = service_factory("reward", {})
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer")})
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt_id": f"p{i}", "prompt": f"sum {i}: <|vision_start|><|image_pad|><|vision_end|>",
             "metadata": {"answer": str(i)}, "images": [png(i, size)]}
            for i, size in enumerate([(84, 56), (112, 56)])]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = DriverConfig.model_validate({
        "rollout": rollout.address, "reward": reward.address, "buffer": buffer.address, "prompts": str(prompts),
        "tokenizer": str(model), "group_size": 2, "groups_per_batch": 2, "max_tokens": 4, "max_groups": 2,
        "max_staleness": 1})

    async def run() -> list[Sample]:
        driver = Driver(cfg)
        try:
            await asyncio.wait_for(driver.run(load_prompts(cfg), asyncio.Event()), 120)
        finally:
            await driver.close()
        async with connect(buffer.address) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            batches = [batch async for batch in stub.Pull(buffer_pb2.PullRequest(batch_size=4, max_batches=1),
                                                          timeout=60)]
        return [Sample.from_proto(proto) for proto in batches[0].samples]

    samples = asyncio.run(run())
    assert len(samples) == 4
    for sample in samples:
        [image] = sample.images
        assert int((sample.prompt_ids == IMAGE_PAD).sum()) == image.num_tokens > 1  # expanded by the rollout
        assert image.data == base64.b64decode(rows[int(sample.prompt_id[1:])]["images"][0])
    assert {s.images[0].grid_thw for s in samples} == {(1, 4, 6), (1, 4, 8)}
    learner = Learner(trainer_config(model, algorithm={"name": "grpo"},
                                     batch={"global_batch_size": 4, "micro_batch_size": 2}), local())
    for sample in samples:  # varied rewards, so the step has a gradient
        sample.reward = float(sample.sample_id.endswith("/1"))
    (mini_batch,) = learner.prepare(samples)
    metrics = learner.train_step(mini_batch, 0)
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-5)
    assert np.isfinite(decode_array(samples[0].to_proto().rollout_logprobs, expect="float32")).all()
