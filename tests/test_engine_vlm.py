"""The native engine serves a vision-language model (qwen2_5_vl) as transformers computes it: the tiny kit's
Qwen2.5-VL, images through its vision tower at prefill and M-RoPE positions through decode; greedy tokens equal,
logprobs within 1e-5 (float32), through chunked prefill, n > 1 and preemption; the prefix cache misses when only the
image changes; mismatched images are refused by field."""

import hashlib

import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

from rollout.config import EngineConfig, ModelConfig
from rollout.engine.errors import InvalidRequest
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.multimodal import ImageInput
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import write_tiny_model

torch.set_num_threads(1)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
MERGE = 2


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("vlm") / "m", arch="qwen2_5_vl", seed=5)


@pytest.fixture(scope="module")
def hf_vlm(vlm_dir):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir).eval()


def picture(seed: int, size: tuple[int, int] = (84, 56)) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def image_input(model_dir, image: Image.Image) -> ImageInput:
    processed = AutoImageProcessor.from_pretrained(model_dir)(images=[image], return_tensors="pt")
    grid = tuple(int(n) for n in processed["image_grid_thw"][0])
    return ImageInput(processed["pixel_values"], grid, hashlib.blake2b(image.tobytes(), digest_size=16).digest())


def image_prompt(config: ModelConfig, images: list[ImageInput], before=(1, 40, 41), between=(50,), after=(60, 61)):
    """<bos> text, then per image: <|vision_start|> its image tokens <|vision_end|> and text."""
    start, pad = config.vision.image_token_id - 2, config.vision.image_token_id  # the kit: start, end, pad
    prompt = list(before)
    for image in images:
        prompt += [start, *[pad] * image.num_tokens(MERGE), start + 1, *between]
    return prompt + list(after)


def hf_inputs(prompt: list[int], images: list[ImageInput], image_token_id: int) -> dict:
    ids = torch.tensor([prompt])
    if not images:
        return {"input_ids": ids}
    return {"input_ids": ids, "pixel_values": torch.cat([image.pixel_values for image in images]),
            "image_grid_thw": torch.tensor([list(image.grid_thw) for image in images]),
            "mm_token_type_ids": (ids == image_token_id).int()}


def reference(hf_model, prompt, images, tokens, image_token_id) -> torch.Tensor:
    inputs = hf_inputs(prompt + tokens, images, image_token_id)
    with torch.no_grad():
        logits = hf_model(**inputs).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def assert_matches(engine: LLMEngine, hf_model, cases, params=GREEDY) -> None:
    image_token_id = engine.model_config.vision.image_token_id
    outputs = engine.generate([prompt for prompt, _ in cases], params, [images for _, images in cases])
    for (prompt, images), out in zip(cases, outputs, strict=True):
        expected = hf_model.generate(**hf_inputs(prompt, images, image_token_id), max_new_tokens=params.max_tokens,
                                     min_new_tokens=params.max_tokens, do_sample=False)[0, len(prompt):].tolist()
        for completion in out.completions:
            assert completion.token_ids == expected
            difference = (torch.tensor(completion.logprobs)
                          - reference(hf_model, prompt, images, completion.token_ids, image_token_id)).abs().max()
            assert difference <= 1e-5, difference


def test_config_reads_the_nested_text_config(vlm_dir):
    config = ModelConfig.from_pretrained(vlm_dir)
    assert (config.model_type, config.hidden_size, config.head_dim, config.attention_bias) == ("qwen2_5_vl", 128, 32, True)
    assert config.vision.mrope_section == (4, 6, 6) and config.vision.spatial_merge_size == MERGE


def test_image_prompts_match_transformers_through_chunks_forks_and_preemption(vlm_dir, hf_vlm):
    one = image_input(vlm_dir, picture(1))  # 84 x 56 -> grid 1 x 4 x 6: 6 image tokens
    two = image_input(vlm_dir, picture(2, (56, 112)))
    assert one.grid_thw == (1, 4, 6) and two.grid_thw == (1, 8, 4)
    config = ModelConfig.from_pretrained(vlm_dir)
    cases = [(image_prompt(config, [one]), [one]), (image_prompt(config, [two, one]), [two, one]),
             ([1, 30, 31, 32], [])]  # text only, beside them
    # chunks of 5 tokens split images; 12 blocks of 4 cannot hold all three (6 + 9 + 3) at once: a preemption recomputes one
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), dtype="float32", block_size=4, num_blocks=12,
                                    max_num_batched_tokens=5, max_num_seqs=4, max_n=2, max_model_len=36))
    assert type(engine.runner.model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert_matches(engine, hf_vlm, cases)
    assert engine.stats["preemptions"] > 0
    forked = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=2)
    assert_matches(LLMEngine(EngineConfig(model=str(vlm_dir), dtype="float32", block_size=4, max_model_len=64)),
                   hf_vlm, cases[:1], forked)


def test_decode_on_static_buffers_carries_the_rope_offset(vlm_dir, hf_vlm):
    one = image_input(vlm_dir, picture(3, (112, 112)))  # 16 image tokens: a rope offset of -12
    config = ModelConfig.from_pretrained(vlm_dir)
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), dtype="float32", block_size=4, max_model_len=64,
                                    cuda_graphs=True))
    assert engine.runner.graphs is not None
    assert_matches(engine, hf_vlm, [(image_prompt(config, [one]), [one])])


def test_the_prefix_cache_misses_when_only_the_image_changes(vlm_dir):
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), dtype="float32", block_size=4, max_model_len=64))
    config = engine.model_config
    first, second = image_input(vlm_dir, picture(1)), image_input(vlm_dir, picture(4))
    prompt = image_prompt(config, [first])
    assert prompt == image_prompt(config, [second])  # the same tokens
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate([prompt], params, [[first]])
    hits = engine.stats["prefix_cache_hit_tokens"]
    engine.generate([prompt], params, [[second]])
    assert engine.stats["prefix_cache_hit_tokens"] == hits  # another image: no block reused
    engine.generate([prompt], params, [[first]])
    assert engine.stats["prefix_cache_hit_tokens"] > hits  # the same image again: its blocks are


def test_images_that_do_not_match_the_prompt_are_refused_by_field(vlm_dir, tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), dtype="float32", block_size=4, max_model_len=64))
    one, big = image_input(vlm_dir, picture(1)), image_input(vlm_dir, picture(3, (112, 112)))
    prompt = image_prompt(engine.model_config, [one])
    with pytest.raises(InvalidRequest, match="images") as missing:
        engine.add_request("a", prompt, GREEDY)
    assert missing.value.field == "images"
    with pytest.raises(InvalidRequest) as wrong_size:
        engine.add_request("b", prompt, GREEDY, [big])
    assert wrong_size.value.field == "images[0]"
    text_engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, max_model_len=64))
    with pytest.raises(InvalidRequest, match="takes no images"):
        text_engine.add_request("c", [1, 2, 3], GREEDY, [one])
    assert not engine.has_unfinished_requests()


def test_an_image_in_a_later_session_turn_continues_the_positions(vlm_dir, hf_vlm):
    config = ModelConfig.from_pretrained(vlm_dir)
    first, second = image_input(vlm_dir, picture(5)), image_input(vlm_dir, picture(6, (56, 112)))
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), dtype="float32", block_size=4, max_model_len=96))
    prompt = image_prompt(config, [first])
    engine.open_session("s", prompt, [first])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)

    def turn(request_id: str) -> tuple[list[int], list[float]]:
        engine.add_session_request(request_id, "s", params)
        tokens, logprobs = [], []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.append(out.token_id)
                logprobs.append(out.logprob)
        return tokens, logprobs

    turn("t1")
    observation = image_prompt(config, [second], before=(2, 70), after=(71,))  # <eos> then an image observation
    engine.append_to_session("s", observation, images=[second])
    context = engine.sessions.sessions["s"].token_ids
    assert config.vision.image_token_id not in context[len(prompt):-len(observation)]  # the turn sampled no image token
    tokens, logprobs = turn("t2")
    image_token_id = config.vision.image_token_id
    expected = hf_vlm.generate(**hf_inputs(context, [first, second], image_token_id), max_new_tokens=5,
                               min_new_tokens=5, do_sample=False)[0, len(context):].tolist()
    assert tokens == expected
    difference = (torch.tensor(logprobs) - reference(hf_vlm, context, [first, second], tokens, image_token_id)).abs()
    assert difference.max() <= 1e-5
    with pytest.raises(InvalidRequest) as refused:  # an image without its run of tokens: nothing appended
        engine.append_to_session("s", [40, 41], images=[second])
    assert refused.value.field == "images" and engine.sessions.sessions["s"].token_ids == context + tokens


@pytest.mark.parametrize("adopt", [False, True])
def test_a_trainers_state_dict_updates_both_towers(vlm_dir, adopt):
    # transformers' in-memory names (model.language_model.*, model.visual.*): what a trainer publishes
    hf_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    with torch.no_grad():
        for name, param in hf_model.named_parameters():
            param.add_(torch.randn_like(param) * 0.05, alpha=1.0 if "visual" in name or "layers" in name else 0.0)
    state = {name: tensor.clone() for name, tensor in hf_model.state_dict().items()}
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), dtype="float32", block_size=4, max_model_len=64))
    assert set(engine.parameter_layout()) == set(state)
    engine.load_weights(state, version=1, adopt=adopt)
    one = image_input(vlm_dir, picture(7))
    assert_matches(engine, hf_model, [(image_prompt(engine.model_config, [one]), [one])])


def test_scoring_a_response_sees_the_prompts_image(vlm_dir, hf_vlm):
    # ComputeLogprobs (a distillation teacher's scores) on an image prompt: transformers' logprobs, two responses
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), dtype="float32", block_size=4, max_model_len=64))
    one = image_input(vlm_dir, picture(9))
    prompt = image_prompt(engine.model_config, [one])
    responses = [[50, 51, 52], [60, 3, 4, 5]]
    scored = engine.compute_logprobs(prompt, responses, images=[one])
    for response, logprobs in zip(responses, scored, strict=True):
        expected = reference(hf_vlm, prompt, [one], response, engine.model_config.vision.image_token_id)
        assert (torch.tensor(logprobs) - expected).abs().max() <= 1e-5
    with pytest.raises(InvalidRequest, match="images"):  # the image's tokens without the image
        engine.compute_logprobs(prompt, responses)
