"""The trainer's policy on a vision-language model: its logprobs of the tokens the native engine sampled on image
prompts equal the engine's (float32, within 1e-5), two samples with different images in one right-padded batch,
the pixels made again from each sample's recorded image bytes and grid."""

import hashlib
import io

import numpy as np
import pytest
import torch
from PIL import Image

from protos.sample import SampleImage
from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.multimodal import ImageInput
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import write_tiny_model
from trainer.model import load_policy, run_policy
from trainer.vision import VisionInputs

torch.set_num_threads(1)
VISION_START, VISION_END, IMAGE_PAD = 101, 102, 103  # the kit's vision tokens (rollout/model/tiny_vlm.py)


def png(seed: int, size) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("vlm") / "m", arch="qwen2_5_vl", seed=7)


def test_the_policy_scores_image_samples_as_the_engine_sampled_them(vlm_dir):
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(vlm_dir)
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), dtype="float32", block_size=4, max_model_len=96))
    samples = []  # (prompt, response, engine logprobs, [SampleImage])
    for seed, size, text in ((1, (84, 56), [40, 41]), (2, (300, 120), [50])):  # the second is resized down
        data = png(seed, size)
        processed = processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
        grid = tuple(int(n) for n in processed["image_grid_thw"][0])
        image = ImageInput(processed["pixel_values"], grid, hashlib.sha256(data).digest())
        count = image.num_tokens(2)
        prompt = [1, *text, VISION_START, *[IMAGE_PAD] * count, VISION_END, 60]
        params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=seed)
        [out] = engine.generate([prompt], params, [[image]])
        completion = out.completions[0]
        samples.append((prompt, completion.token_ids, completion.logprobs,
                        [SampleImage(image.hash, "image/png", grid, count, data)]))
    assert samples[0][3][0].grid_thw != samples[1][3][0].grid_thw

    policy = load_policy(vlm_dir)
    rows = [prompt + response for prompt, response, _, _ in samples]
    width = max(map(len, rows))
    input_ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    attention_mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    vision = VisionInputs.for_model(vlm_dir)([images for *_, images in samples], input_ids)
    with torch.no_grad():
        out = run_policy(policy, input_ids, attention_mask, vision=vision)
    for row, (prompt, response, logprobs, _) in enumerate(samples):
        trainer_logprobs = out.logprobs[row, len(prompt) - 1 : len(prompt) - 1 + len(response)]
        assert np.abs(trainer_logprobs.numpy() - np.array(logprobs)).max() <= 1e-5
    with torch.no_grad():  # without the images the same tokens score otherwise: the test sees the pixels
        blind = run_policy(policy, input_ids, attention_mask)
    assert (blind.logprobs - out.logprobs).abs().max() > 1e-3


def test_a_text_model_needs_no_vision_inputs(tiny_model_dir):
    assert VisionInputs.for_model(tiny_model_dir) is None
