"""The trainer's policy on a vision-language model: its logprobs of the tokens the native engine sampled on image
prompts equal the engine's (float32, within 1e-5), samples with different images in one right-padded batch, the
pixels made again from each sample's recorded image bytes and grid; through the learner, a GRPO step on them starts
at ratio 1."""

import dataclasses
import hashlib
import io

import numpy as np
import pytest
import torch
from PIL import Image
from test_trainer_step import config, local
from transformers import AutoImageProcessor

from protos.sample import Sample, SampleImage
from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.multimodal import ImageInput
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import write_tiny_model
from trainer.batch import collate
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.model import Packing, load_policy, run_policy
from trainer.varlen import use_varlen
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


def engine_samples(vlm_dir) -> list[Sample]:
    """Two image prompts of different grids (the second resized down), two completions each at temperature 1, as
    the native engine samples them, with the images as the rollout records them."""
    processor = AutoImageProcessor.from_pretrained(vlm_dir)
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), dtype="float32", block_size=4, max_model_len=96))
    samples = []
    for seed, size, text in ((1, (84, 56), [40, 41]), (2, (300, 120), [50])):
        data = png(seed, size)
        processed = processor(images=[Image.open(io.BytesIO(data)).convert("RGB")], return_tensors="pt")
        grid = tuple(int(n) for n in processed["image_grid_thw"][0])
        image = ImageInput(processed["pixel_values"], grid, hashlib.sha256(data).digest())
        count = image.num_tokens(2)
        prompt = [1, *text, VISION_START, *[IMAGE_PAD] * count, VISION_END, 60]
        params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=seed, n=2)
        [out] = engine.generate([prompt], params, [[image]])
        for completion in out.completions:
            samples.append(Sample(
                sample_id=f"s{seed}-{completion.index}", prompt_id=f"p{seed}", group_size=2,
                prompt_ids=np.array(prompt, np.int32), response_ids=np.array(completion.token_ids, np.int32),
                loss_mask=np.ones(6, np.uint8), rollout_logprobs=np.array(completion.logprobs, np.float32),
                weight_versions=np.zeros(6, np.int64), reward=float(completion.index), temperature=1.0,
                images=[SampleImage(image.hash, "image/png", grid, count, data)]))
    assert samples[0].images[0].grid_thw != samples[2].images[0].grid_thw
    return samples


def test_the_policy_scores_image_samples_as_the_engine_sampled_them(vlm_dir):
    samples = engine_samples(vlm_dir)
    policy = load_policy(vlm_dir)
    batch = collate(samples, vision=policy.vision)  # right-padded rows, each with its own image
    with torch.no_grad():
        out = run_policy(policy, batch.input_ids, batch.attention_mask, images=batch.images)
        blind = run_policy(policy, batch.input_ids, batch.attention_mask)  # the same tokens without the pixels
    for row, sample in enumerate(samples):
        start = sample.prompt_ids.size - 1
        trainer_logprobs = out.logprobs[row, start : start + sample.response_ids.size].numpy()
        assert np.abs(trainer_logprobs - sample.rollout_logprobs).max() <= 1e-5
    assert (blind.logprobs - out.logprobs).abs().max() > 1e-3
    # A response that samples the image token keeps it as text, as the engine did: only the prompt's runs are images.
    sample = samples[0]
    sample.response_ids = np.r_[sample.response_ids[:-1], IMAGE_PAD].astype(np.int32)
    batch = collate([sample], vision=policy.vision)
    marked = policy.vision.from_batch(*batch.images, batch.input_ids)["mm_token_type_ids"]
    assert int(marked.sum()) == sample.images[0].num_tokens == int((batch.input_ids == IMAGE_PAD).sum()) - 1
    # ... also before a later image (a session's observation): the runs as long as each image are its images
    response_ids = np.r_[IMAGE_PAD, 40, [IMAGE_PAD] * 6, 41].astype(np.int32)
    two = collate([dataclasses.replace(sample, response_ids=response_ids, loss_mask=np.ones(9, np.uint8),
                                       rollout_logprobs=np.zeros(9, np.float32), weight_versions=np.zeros(9, np.int64),
                                       images=[sample.images[0], sample.images[0]])], vision=policy.vision)
    runs = policy.vision.from_batch(*two.images, two.input_ids)["mm_token_type_ids"][0]
    response = runs[sample.prompt_ids.size:].tolist()
    assert int(runs.sum()) == 12 and response == [0, 0, 1, 1, 1, 1, 1, 1, 0]
    with torch.no_grad():
        again = run_policy(policy, batch.input_ids, batch.attention_mask, images=batch.images).logprobs
    assert (again[0, : again.shape[1] - 1] - out.logprobs[0, : again.shape[1] - 1]).abs().max() <= 1e-5


def test_a_grpo_step_on_image_samples_starts_on_policy(vlm_dir):
    # The learner collates the images with the tokens, micro-batches them (2 rows each) and its forward sees them:
    # on the engine's own samples the first step's ratio is 1.
    learner = Learner(config(vlm_dir, algorithm={"name": "grpo"},
                             batch={"global_batch_size": 4, "micro_batch_size": 2}), local())
    (mini_batch,) = learner.prepare(engine_samples(vlm_dir))
    assert mini_batch.images is not None
    metrics = learner.train_step(mini_batch, 0)
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-5) and metrics["grad_norm"] > 0


@pytest.mark.parametrize("attention", ["mask", "varlen"])
def test_packed_rows_with_images_score_as_the_padded_ones(vlm_dir, attention):
    """Image samples (two grids) and a text one packed end to end: each sample's 3-D positions restart in its packed
    place and its images reach the tower in the packed order; logprobs equal the padded forward's, and the engine's,
    within 1e-5 (before, packing refused rows with images)."""
    samples = engine_samples(vlm_dir)
    text = dataclasses.replace(samples[1], sample_id="t", prompt_ids=np.array([1, 40, 41, 60], np.int32), images=[])
    samples = [samples[0], text, samples[2], samples[3], samples[1]]
    policy = load_policy(vlm_dir)
    if attention == "varlen":
        use_varlen(policy.lm)
    batch = collate(samples, vision=policy.vision)
    with torch.no_grad():
        padded = run_policy(policy, batch.input_ids, batch.attention_mask, images=batch.images).logprobs
        for row_tokens in (None, 40):  # one row; rows of about 40 tokens (two samples share one, some alone)
            packed = run_policy(policy, batch.input_ids, batch.attention_mask, images=batch.images,
                                packing=Packing(row_tokens)).logprobs
            columns = batch.attention_mask[:, 1:].bool()
            assert (packed - padded)[columns].abs().max() <= 1e-5
    for row, sample in enumerate(samples):
        if sample.images:
            start = sample.prompt_ids.size - 1
            got = packed[row, start : start + sample.response_ids.size].numpy()
            assert np.abs(got - sample.rollout_logprobs).max() <= 1e-5


def test_a_packed_grpo_step_on_image_samples_starts_on_policy(vlm_dir):
    learner = Learner(config(vlm_dir, algorithm={"name": "grpo"},
                             batch={"global_batch_size": 4, "micro_batch_size": 4, "packing": True}), local())
    (mini_batch,) = learner.prepare(engine_samples(vlm_dir))
    metrics = learner.train_step(mini_batch, 0)
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-5) and metrics["grad_norm"] > 0


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_vision_keeps_the_tower_as_loaded(vlm_dir, freeze):
    learner = Learner(TrainerConfig.model_validate({
        "model_path": str(vlm_dir), "optim": {"lr": 1e-3}, "algorithm": {"name": "grpo"},
        "model": {"freeze_vision": freeze}, "batch": {"global_batch_size": 4, "micro_batch_size": 4}}), local())
    before = {name: p.detach().clone() for name, p in learner.policy.named_parameters()}
    (mini_batch,) = learner.prepare(engine_samples(vlm_dir))
    learner.train_step(mini_batch, 0)
    moved = {name for name, p in learner.policy.named_parameters() if not torch.equal(p, before[name])}
    assert any("layers" in name for name in moved)  # the decoder learns either way
    assert any("visual" in name for name in moved) != freeze


def test_a_text_model_needs_no_vision_inputs(tiny_model_dir):
    assert VisionInputs.for_model(tiny_model_dir) is None


def test_an_export_carries_the_image_processor(vlm_dir, tmp_path):
    # The rollout reads a served folder's images with its image processor: an SFT warm-up's or a run's export must
    # have it (before, the rollout on the warm-up's folder exited: no preprocessor_config.json).
    from trainer.checkpoint import TrainState, export_checkpoint_hf, export_hf, save_checkpoint

    learner = Learner(config(vlm_dir, algorithm={"name": "grpo"},
                             batch={"global_batch_size": 4, "micro_batch_size": 4}), local())
    checkpoint = save_checkpoint(tmp_path / "ckpt", learner.policy, learner.optimizer, TrainState(), local())
    for out in (export_hf(tmp_path / "export", learner.policy, vlm_dir, local()),
                export_checkpoint_hf(checkpoint, vlm_dir, tmp_path / "from_checkpoint")):
        processor = AutoImageProcessor.from_pretrained(out)
        assert dict(processor.size) == {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}  # min, max pixels
