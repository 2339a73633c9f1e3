"""Prefill/decode disaggregation with images: a prefill worker and a decode worker (real processes on loopback) serving
the tiny Qwen2.5-VL. The prefill worker runs the vision tower, the transfer carries the prompt's M-RoPE positions and
its images, and the split run equals the monolithic engine (rollout/pd/prefill.py, rollout/pd/decode.py,
rollout/pd/transfer.py)."""

import asyncio
import hashlib

import grpc
import pytest
import torch
from test_rollout_images import IMAGE_PAD, VISION_END, VISION_START, png

from protos import kv_pb2, kv_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_array, encode_array
from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import write_tiny_model
from rollout.serve.config import ImageSettings
from rollout.serve.images import ImageReader
from services.client import connect

torch.set_num_threads(1)
ENGINE = {"engine.max_model_len": 128, "engine.dtype": "float32", "engine.torch_threads": 1}
# two images of different grids (6 and 8 tokens), text around them: the text after each image resumes at a position
# other than its index, so decoding continues at index + an offset the decode worker must be told
PROMPT = [1, 40, 41, VISION_START, IMAGE_PAD, VISION_END, 60, VISION_START, IMAGE_PAD, VISION_END, 61, 62]
IMAGES = [png(1), png(2, size=(112, 56))]


def parts(images=IMAGES) -> list[rollout_pb2.ImagePart]:
    return [rollout_pb2.ImagePart(data=data, media_type="image/png", sha256=hashlib.sha256(data).digest())
            for data in images]


def request_of(request_id: str, images=IMAGES, max_tokens: int = 8, **params) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        request_id=request_id, prompt_ids=encode_array(PROMPT, "int32"), images=parts(images),
        params=rollout_pb2.SamplingParams(logprobs=True, ignore_eos=True, max_tokens=max_tokens, **params))


def tokens_and_logprobs(completions) -> list[tuple[list[int], list[float]]]:
    return [(decode_array(c.token_ids).tolist(), decode_array(c.logprobs).tolist()) for c in completions]


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("vlm") / "m", arch="qwen2_5_vl", seed=5)


@pytest.fixture(scope="module")
def split(vlm_dir, tmp_path_factory):
    from deploy.local.service_process import start_service

    logs = tmp_path_factory.mktemp("pd-images-logs")
    model = {"model": str(vlm_dir), **ENGINE}
    started = {"prefill": start_service("prefill", model, log_dir=logs)}
    started["decode"] = start_service("decode", {**model, "prefill": [started["prefill"].address]}, log_dir=logs)
    yield started
    for service in started.values():
        service.stop(timeout=10)


def monolithic(vlm_dir, images, params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    """The monolithic engine's completions of PROMPT with `images` (its runs expanded as the servers expand them)."""
    reader = ImageReader.for_model(str(vlm_dir), ImageSettings())
    read = reader.read(parts(images))
    engine = LLMEngine(EngineConfig(model=str(vlm_dir), max_model_len=128, max_n=4, dtype="float32"))
    [output] = engine.generate([reader.expand(PROMPT, read)], params, images=[[r.image for r in read]])
    return [(c.token_ids, c.logprobs) for c in output.completions]


async def generate(address: str, request) -> tuple[rollout_pb2.GenerateResponse, list[rollout_pb2.GenerateChunk]]:
    async with connect(address) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        whole = await stub.Generate(request, timeout=120)
        return whole, [chunk async for chunk in stub.GenerateStream(request, timeout=120)]


def test_a_split_run_on_an_image_prompt_equals_the_monolithic_engine(vlm_dir, split):
    """Greedy, and sampled with a seed (n=3): the decode worker's tokens equal the monolithic engine's, logprobs within
    1e-5 in float32, the stream's too. Before, the decode worker refused every request with images."""
    for params in ({"temperature": 0.0}, {"temperature": 1.0, "n": 3, "seed": 11}):
        whole, chunks = asyncio.run(generate(split["decode"].address, request_of("r", **params)))
        expected = monolithic(vlm_dir, IMAGES, SamplingParams(max_tokens=8, ignore_eos=True, **params))
        got = tokens_and_logprobs(whole.completions)
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
        assert max(abs(a - b) for (_, x), (_, y) in zip(got, expected) for a, b in zip(x, y)) < 1e-5
        streamed: dict[int, list[int]] = {}
        for chunk in chunks:
            streamed.setdefault(chunk.index, []).extend(decode_array(chunk.token_ids).tolist())
        assert [streamed[i] for i in sorted(streamed)] == [tokens for tokens, _ in got]
        assert [list(ref.grid_thw) for ref in whole.images] == [[1, 4, 6], [1, 4, 8]]
        assert decode_array(whole.prompt_ids).tolist().count(IMAGE_PAD) == 6 + 8
    # the same text with another image: other tokens (the prefill worker's prefix cache keys on the images)
    other, _ = asyncio.run(generate(split["decode"].address, request_of("o", images=[png(3), IMAGES[1]],
                                                                         temperature=0.0)))
    expected = monolithic(vlm_dir, [png(3), IMAGES[1]], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    assert tokens_and_logprobs(other.completions)[0][0] == expected[0][0] != got[0][0]


async def prefill(address: str, request) -> list[kv_pb2.KVTransferChunk]:
    async with connect(address) as channel:
        stub = kv_pb2_grpc.PrefillWorkerStub(channel)
        return [c async for c in stub.Prefill(kv_pb2.PrefillRequest(request=request), timeout=60)]


async def continue_(address: str, chunks) -> list[rollout_pb2.GenerateChunk]:
    async with connect(address) as channel:
        return [c async for c in kv_pb2_grpc.DecodeWorkerStub(channel).Continue(iter(chunks), timeout=60)]


def changed(chunks, change) -> list[kv_pb2.KVTransferChunk]:
    header = kv_pb2.KVTransferHeader()
    header.CopyFrom(chunks[0].header)
    change(header)
    return [kv_pb2.KVTransferChunk(header=header), *chunks[1:]]


@pytest.mark.parametrize("change, words", [
    (lambda h: setattr(h, "mrope_delta", h.mrope_delta + 1), "mrope_positions: the transfer's positions (offset"),
    (lambda h: h.ClearField("mrope_positions"), "mrope_positions: the transfer carries none for a prompt with 2"),
    (lambda h: h.mrope_positions.CopyFrom(encode_array(list(range(30)), "int32")), "30 positions for a prompt of"),
    (lambda h: h.request.images.pop(), "2 runs of image tokens, the request 1 images"),
])
def test_a_transfer_whose_positions_do_not_fit_its_images_is_refused(split, change, words):
    """The transfer carries the positions and the images (as data parts); Continue decodes it, and one whose positions
    are not those its images give the prompt is refused by name while the decode worker serves on."""
    chunks = asyncio.run(prefill(split["prefill"].address, request_of("c", temperature=0.0)))
    header = chunks[0].header
    prompt = decode_array(header.request.prompt_ids).tolist()
    assert len(prompt) == len(PROMPT) - 2 + 6 + 8 and header.mrope_positions.length == 3 * len(prompt)
    assert header.mrope_delta == -7  # 14 image tokens take 3 + 4 positions: the 25th token sits at position 17
    assert [image.data for image in header.request.images] == IMAGES
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(continue_(split["decode"].address, changed(chunks, change)))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()
    good = asyncio.run(continue_(split["decode"].address, chunks))
    first_token = decode_array(header.first_token_ids).tolist()[0]
    tokens = [t for c in good for t in decode_array(c.token_ids).tolist()]
    assert len(tokens) == 8 and tokens[0] == first_token


def test_bad_image_parts_are_refused_by_name_by_both_workers(split):
    bad = rollout_pb2.GenerateRequest(prompt_ids=encode_array(PROMPT, "int32"),
                                      images=[*parts(IMAGES[:1]), rollout_pb2.ImagePart(data=b"not an image")],
                                      params=rollout_pb2.SamplingParams(max_tokens=4))
    for call in (lambda: generate(split["decode"].address, bad), lambda: prefill(split["prefill"].address, bad)):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            asyncio.run(call())
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "images[1]" in refused.value.details()
    whole, _ = asyncio.run(generate(split["decode"].address, request_of("after", temperature=0.0, max_tokens=2)))
    assert len(decode_array(whole.completions[0].token_ids)) == 2


def test_an_imported_image_prompt_preempted_on_the_decode_engine_is_recomputed_with_its_images(vlm_dir):
    """In-process, the hand-off itself (rollout/engine/kv_handoff.py): two imported image prompts of 24 tokens (7
    blocks of 4 each) grow past a decode engine of 16 blocks, so one is preempted and recomputed from its tokens, vision tower included (the
    import kept its images); each one's greedy tokens equal the monolithic engine's."""
    from rollout.engine.kv_handoff import add_prefilled_request, prefill_for_transfer

    reader = ImageReader.for_model(str(vlm_dir), ImageSettings())
    config = {"model": str(vlm_dir), "max_model_len": 64, "dtype": "float32", "block_size": 4}
    prefill_engine, decode_engine = LLMEngine(EngineConfig(**config)), LLMEngine(EngineConfig(**config, num_blocks=16))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, seed=1)  # the transfer's seed
    tokens: dict[str, list[int]] = {}
    expected = {}
    for i, images in enumerate([IMAGES, [png(3), IMAGES[1]]]):
        read = reader.read(parts(images))
        prompt, inputs = reader.expand(PROMPT, read), [r.image for r in read]
        [output] = prefill_engine.generate([prompt], params, images=[inputs])
        expected[f"r{i}"] = output.completions[0].token_ids
        prefilled = prefill_for_transfer(prefill_engine, f"r{i}", prompt, params, inputs)
        for token in add_prefilled_request(decode_engine, f"r{i}", prefilled, params, inputs):
            tokens.setdefault(token.request_id, []).append(token.token_id)
    while decode_engine.requests:
        for token in decode_engine.step():
            tokens.setdefault(token.request_id, []).append(token.token_id)
    assert decode_engine.stats["preemptions"] > 0
    assert tokens == expected
