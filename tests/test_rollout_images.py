"""Images through a real rollout service process (a tiny Qwen2.5-VL): image parts on the wire, the prompt's one-token
image runs expanded, greedy tokens equal transformers' on the same image; bad parts refused with INVALID_ARGUMENT
naming the part while the server keeps serving; a sample's images survive its wire form."""

import asyncio
import base64
import functools
import hashlib
import io
import json
import pathlib
import shutil
import socket
import subprocess

import grpc
import numpy as np
import openai
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

from protos import rollout_pb2, rollout_pb2_grpc
from protos.codec import CodecError, decode_array, encode_array
from protos.sample import Sample, SampleImage
from rollout.model.tiny import write_tiny_model
from rollout.serve.config import ImageSettings
from rollout.serve.images import ImageReader
from services.client import connect

torch.set_num_threads(1)
VISION_START, VISION_END, IMAGE_PAD = 101, 102, 103  # the kit's vision tokens (rollout/model/tiny_vlm.py)
PROMPT = [1, 40, 41, VISION_START, IMAGE_PAD, VISION_END, 60, 61]  # one image token: the server expands it


def png(seed: int, size=(84, 56), kind="PNG") -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=generator, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, kind)
    return out.getvalue()


def request(images, prompt=PROMPT, **params) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompt_ids=encode_array(prompt, "int32"), images=images,
        params=rollout_pb2.SamplingParams(**{"temperature": 0.0, "max_tokens": 6, "ignore_eos": True, "logprobs": True,
                                             **params}))


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("vlm") / "m", arch="qwen2_5_vl", seed=5)


@pytest.fixture(scope="module")
def image_root(tmp_path_factory):
    """The rollout's images.file_root: file:// image parts may name files under it."""
    return tmp_path_factory.mktemp("image-root")


@pytest.fixture(scope="module")
def vlm_rollout(vlm_dir, image_root, tmp_path_factory):
    from deploy.local.service_process import start_service

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    service = start_service("rollout", {"model": str(vlm_dir), "engine.max_model_len": 128, "engine.dtype": "float32",
                                        "engine.torch_threads": 1, "images.max_image_pixels": 200 * 200,
                                        "images.file_root": str(image_root),
                                        "openai.port": port}, log_dir=tmp_path_factory.mktemp("rollout-logs"))
    service.openai_url = f"http://127.0.0.1:{port}/v1"
    yield service
    service.stop(timeout=10)


def test_an_image_prompt_through_the_service_matches_transformers(vlm_dir, vlm_rollout):
    data = png(1)

    async def main():
        async with connect(vlm_rollout.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            part = rollout_pb2.ImagePart(data=data, media_type="image/png", sha256=hashlib.sha256(data).digest())
            whole = await stub.Generate(request([part]), timeout=60)
            chunks = [chunk async for chunk in stub.GenerateStream(request([part]), timeout=60)]
            return whole, chunks

    whole, chunks = asyncio.run(main())
    [ref] = whole.images
    assert ref.sha256 == hashlib.sha256(data).digest() and ref.media_type == "image/png"
    assert list(ref.grid_thw) == [1, 4, 6] and ref.num_tokens == 6 and not ref.data
    prompt = decode_array(whole.prompt_ids, expect="int32").tolist()
    assert prompt == PROMPT[:4] + [IMAGE_PAD] * 6 + PROMPT[5:] and whole.prompt_tokens == len(prompt)
    tokens = decode_array(whole.completions[0].token_ids, expect="int32").tolist()
    assert [t for c in chunks for t in decode_array(c.token_ids, expect="int32").tolist()] == tokens

    processed = AutoImageProcessor.from_pretrained(vlm_dir)(images=[Image.open(io.BytesIO(data)).convert("RGB")],
                                                            return_tensors="pt")
    ids = torch.tensor([prompt])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    expected = model.generate(input_ids=ids, pixel_values=processed["pixel_values"],
                              image_grid_thw=processed["image_grid_thw"], mm_token_type_ids=(ids == IMAGE_PAD).int(),
                              max_new_tokens=6, min_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert tokens == expected


def test_bad_image_parts_are_refused_by_name_and_the_server_keeps_serving(vlm_rollout):
    good = rollout_pb2.ImagePart(data=png(2))
    bad = {
        "not an image": rollout_pb2.ImagePart(data=b"hello, not a picture"),
        "too many pixels": rollout_pb2.ImagePart(data=png(3, (300, 300))),
        "a wrong hash": rollout_pb2.ImagePart(data=png(2), sha256=b"\0" * 32),
        "a wrong media type": rollout_pb2.ImagePart(data=png(2), media_type="image/jpeg"),
    }

    async def main():
        async with connect(vlm_rollout.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            errors = {}
            for name, part in bad.items():
                two = PROMPT + [VISION_START, IMAGE_PAD, VISION_END]
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.Generate(request([good, part], two), timeout=60)
                errors[name] = error.value
            with pytest.raises(grpc.aio.AioRpcError) as many:
                await stub.GenerateMany(rollout_pb2.GenerateManyRequest(
                    requests=[request([good]), request([bad["not an image"]])]), timeout=60)
            with pytest.raises(grpc.aio.AioRpcError) as mismatched:  # two images for one run of image tokens
                await stub.Generate(request([good, good]), timeout=60)
            after = await stub.Generate(request([good]), timeout=60)
            return errors, many.value, mismatched.value, after

    errors, many, mismatched, after = asyncio.run(main())
    for name, error in errors.items():
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
        assert error.details().startswith("images[1]"), (name, error.details())
    assert "pixels exceed max_image_pixels=40000" in errors["too many pixels"].details()
    assert many.code() == grpc.StatusCode.INVALID_ARGUMENT and many.details().startswith("requests[1].images[0]")
    assert mismatched.code() == grpc.StatusCode.INVALID_ARGUMENT and "images" in mismatched.details()
    assert len(decode_array(after.completions[0].token_ids, expect="int32")) == 6  # still serving


def test_file_uris_under_the_root_are_read_and_the_rest_refused_by_name(vlm_rollout, image_root, tmp_path):
    data = png(6)
    (image_root / "six.png").write_bytes(data)
    outside = tmp_path / "outside.png"
    outside.write_bytes(data)
    (image_root / "link.png").symlink_to(outside)
    bad = {
        "is outside images.file_root": outside.as_uri(),
        "is outside images.file_root ": f"file://{image_root}/../{tmp_path.name}/outside.png",  # `..` out of the root
        "is outside images.file_root  ": (image_root / "link.png").as_uri(),  # a symlink out of the root
        "no file": (image_root / "missing.png").as_uri(),
        "remote image URLs are refused": "http://127.0.0.1:9/six.png",
        "URIs are not served": "ftp://example.com/six.png",
    }

    async def main():
        async with connect(vlm_rollout.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            by_uri = await stub.Generate(request([rollout_pb2.ImagePart(uri=(image_root / "six.png").as_uri())]),
                                         timeout=60)
            by_bytes = await stub.Generate(request([rollout_pb2.ImagePart(data=data)]), timeout=60)
            errors = {}
            two = PROMPT + [VISION_START, IMAGE_PAD, VISION_END]
            for reason, uri in {**bad, "give data or uri": None}.items():
                part = rollout_pb2.ImagePart(uri=uri) if uri else rollout_pb2.ImagePart(data=data, uri=outside.as_uri())
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.Generate(request([rollout_pb2.ImagePart(data=png(2)), part], two), timeout=60)
                errors[reason] = error.value
            after = await stub.Generate(request([rollout_pb2.ImagePart(data=png(2))]), timeout=60)
            return by_uri, by_bytes, errors, after

    by_uri, by_bytes, errors, after = asyncio.run(main())
    assert by_uri.images[0].sha256 == hashlib.sha256(data).digest() == by_bytes.images[0].sha256
    assert by_uri.completions[0].token_ids == by_bytes.completions[0].token_ids
    for reason, error in errors.items():
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, reason
        assert error.details().startswith("images[1]") and reason.strip() in error.details(), (reason, error.details())
    assert len(decode_array(after.completions[0].token_ids, expect="int32")) == 6  # still serving


def test_remote_image_urls_are_fetched_only_where_allowed(vlm_dir, tmp_path):
    import http.server
    import threading

    data = png(7)
    (tmp_path / "seven.png").write_bytes(data)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_address[1]}/seven.png"
        part = rollout_pb2.ImagePart(uri=url)
        [read] = ImageReader(str(vlm_dir), ImageSettings(allow_remote_urls=True)).read([part])
        with pytest.raises(CodecError, match=r"^images\[0\]\.uri: remote image URLs are refused"):
            ImageReader(str(vlm_dir), ImageSettings()).read([part])
        with pytest.raises(CodecError, match=r"^images\[0\]\.uri: over images.max_image_bytes"):
            ImageReader(str(vlm_dir), ImageSettings(allow_remote_urls=True, max_image_bytes=100)).read([part])
        with pytest.raises(CodecError, match=r"^images\[0\]\.uri: fetching .* failed: HTTP Error 404"):
            ImageReader(str(vlm_dir), ImageSettings(allow_remote_urls=True)).read(
                [rollout_pb2.ImagePart(uri=url + ".missing")])
        server.shutdown()
    assert read.image.hash == hashlib.sha256(data).digest() and read.image.data == data
    with pytest.raises(CodecError, match=r"^images\[0\]\.uri: file:// images are refused here"):
        ImageReader(str(vlm_dir), ImageSettings()).read([rollout_pb2.ImagePart(uri=(tmp_path / "seven.png").as_uri())])


def test_the_openai_client_sends_an_image_url_part(vlm_dir, vlm_rollout, image_root):
    data = png(4)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    content = [{"type": "text", "text": "what is this? "}, {"type": "image_url", "image_url": {"url": url}}]
    # the same prompt as the template renders it, the image as one image token the server expands
    text = AutoTokenizer.from_pretrained(vlm_dir).apply_chat_template(
        [{"role": "user", "content": "what is this? <|vision_start|><|image_pad|><|vision_end|>"}], tokenize=False,
        add_generation_prompt=True)
    prompt = AutoTokenizer.from_pretrained(vlm_dir)(text, add_special_tokens=False).input_ids
    assert prompt.count(IMAGE_PAD) == 1

    async def main():
        client = openai.AsyncOpenAI(base_url=vlm_rollout.openai_url, api_key="unused", max_retries=0, timeout=60)
        reply = await client.chat.completions.create(model=str(vlm_dir), messages=[{"role": "user", "content": content}],
                                                     temperature=0, max_tokens=6)
        (image_root / "four.png").write_bytes(data)  # the same image as a file under images.file_root
        by_file = await client.chat.completions.create(model=str(vlm_dir), temperature=0, max_tokens=6, messages=[
            {"role": "user", "content": [*content[:1], {"type": "image_url",
                                                        "image_url": {"url": (image_root / "four.png").as_uri()}}]}])
        assert by_file.choices[0].message.content == reply.choices[0].message.content
        with pytest.raises(openai.BadRequestError, match=r"images\[0\]\.uri: remote image URLs are refused"):
            await client.chat.completions.create(model=str(vlm_dir), max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
        with pytest.raises(openai.BadRequestError, match=r"images\[0\]: not an image"):
            bad = "data:image/png;base64," + base64.b64encode(b"not a picture").decode()
            await client.chat.completions.create(model=str(vlm_dir), max_tokens=2, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": bad}}]}])
        async with connect(vlm_rollout.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            direct = await stub.Generate(rollout_pb2.GenerateRequest(
                prompt_ids=encode_array(prompt, "int32"), images=[rollout_pb2.ImagePart(data=data)],
                params=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=6)), timeout=60)
        return reply, direct

    reply, direct = asyncio.run(main())
    assert reply.usage.prompt_tokens == direct.prompt_tokens == len(prompt) - 1 + 6  # 84 x 56: 6 image tokens
    assert reply.choices[0].message.content == direct.completions[0].text


def test_a_session_with_an_image_observation_through_the_service(vlm_dir, vlm_rollout):
    first, second = png(5), png(6, (56, 112))

    async def turn(stub, session_id: str) -> list[int]:
        chunks = [chunk async for chunk in stub.GenerateInSession(rollout_pb2.GenerateInSessionRequest(
            session_id=session_id, whole_turn=True,
            params=rollout_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)), timeout=60)]
        return [t for c in chunks for t in decode_array(c.token_ids, expect="int32").tolist()]

    async def main():
        async with connect(vlm_rollout.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            opened = await stub.OpenSession(rollout_pb2.OpenSessionRequest(
                session_id="seen", prompt_ids=encode_array(PROMPT, "int32"),
                images=[rollout_pb2.ImagePart(data=first)]), timeout=60)
            one = await turn(stub, "seen")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
                    session_id="seen", token_ids=encode_array([2, VISION_START, IMAGE_PAD, VISION_END], "int32"),
                    images=[rollout_pb2.ImagePart(data=b"no picture")]), timeout=60)
            appended = await stub.AppendToSession(rollout_pb2.AppendToSessionRequest(
                session_id="seen", token_ids=encode_array([2, VISION_START, IMAGE_PAD, VISION_END, 70], "int32"),
                images=[rollout_pb2.ImagePart(data=second)]), timeout=60)
            two = await turn(stub, "seen")
            closed = await stub.CloseSession(rollout_pb2.CloseSessionRequest(session_id="seen"), timeout=60)
            return opened, one, refused.value, appended, two, Sample.from_proto(closed.sample)

    opened, one, refused, appended, two, sample = asyncio.run(main())
    # the episode's sample keeps both images, in order, with what the trainer needs
    assert [(image.data, image.grid_thw, image.num_tokens) for image in sample.images] == [
        (first, (1, 4, 6), 6), (second, (1, 8, 4), 8)]
    assert [image.sha256 for image in sample.images] == [hashlib.sha256(data).digest() for data in (first, second)]
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and refused.details().startswith("images[0]")
    observation = decode_array(appended.token_ids, expect="int32").tolist()
    assert observation.count(IMAGE_PAD) == 8  # 56 x 112: grid 1 x 8 x 4
    context = decode_array(opened.token_ids, expect="int32").tolist() + one + observation
    assert appended.num_tokens == len(context)  # the refused append added nothing
    processor = AutoImageProcessor.from_pretrained(vlm_dir)
    processed = processor(images=[Image.open(io.BytesIO(data)).convert("RGB") for data in (first, second)],
                          return_tensors="pt")
    ids = torch.tensor([context])
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(vlm_dir).eval()
    expected = model.generate(input_ids=ids, pixel_values=processed["pixel_values"],
                              image_grid_thw=processed["image_grid_thw"], mm_token_type_ids=(ids == IMAGE_PAD).int(),
                              max_new_tokens=4, min_new_tokens=4, do_sample=False)[0, len(context):].tolist()
    assert IMAGE_PAD not in one and two == expected


def test_compute_logprobs_takes_the_prompts_images(vlm_rollout):
    # a teacher's scores of an image prompt's completion equal the logprobs the rollout sampled them with
    data = png(10)

    async def main():
        async with connect(vlm_rollout.address) as channel:
            stub = rollout_pb2_grpc.RolloutStub(channel)
            part = rollout_pb2.ImagePart(data=data)
            sampled = await stub.Generate(request([part], temperature=1.0, seed=3), timeout=60)
            completion = sampled.completions[0]
            scored = await stub.ComputeLogprobs(rollout_pb2.ComputeLogprobsRequest(
                prompt_ids=encode_array(PROMPT, "int32"), response_ids=[completion.token_ids], images=[part]),
                timeout=60)
            return decode_array(completion.logprobs, expect="float32"), decode_array(scored.logprobs[0],
                                                                                     expect="float32")

    sampled, scored = asyncio.run(main())
    assert np.abs(sampled - scored).max() <= 1e-5


def test_the_held_out_evaluation_sends_each_prompts_images(vlm_rollout):
    from deploy.rl.evaluation import greedy_completions

    images = [[png(1)], [png(2, (112, 56))]]
    completions = asyncio.run(greedy_completions(vlm_rollout.address, [PROMPT, PROMPT], 4, images=images,
                                                 retry_for_s=0))
    assert [len(decode_array(c.token_ids, expect="int32")) for c in completions] == [4, 4]
    with pytest.raises(grpc.aio.AioRpcError, match="images"):  # the placeholder without its image is refused
        asyncio.run(greedy_completions(vlm_rollout.address, [PROMPT], 4, retry_for_s=0))


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_a_node_environment_returns_an_image_observation(vlm_rollout, tmp_path):
    node_env = pathlib.Path(__file__).resolve().parent.parent / "examples" / "node_env"
    if not (node_env / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=node_env, check=True, timeout=300)
    data = png(8, (56, 112))
    (tmp_path / "seen.png").write_bytes(data)
    observation = [2, VISION_START, IMAGE_PAD, VISION_END, 70]
    done = subprocess.run(["node", str(node_env / "image_observation.js"), vlm_rollout.address,
                           str(tmp_path / "seen.png"), ",".join(map(str, PROMPT[:3] + [60])),
                           ",".join(map(str, observation))], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert [len(turn) for turn in result["turns"]] == [4, 4]
    assert result["observation"].count(IMAGE_PAD) == 8  # expanded by the server: 56 x 112 -> 8 image tokens
    assert result["images"] == [{"sha256": hashlib.sha256(data).hexdigest(), "media_type": "image/png",
                                 "grid_thw": [1, 8, 4], "num_tokens": 8, "bytes": len(data)}]


def test_an_openai_session_takes_images_in_its_turns(vlm_dir, vlm_rollout):
    import httpx

    first, second = png(11), png(12, (56, 112))

    def part(data: bytes) -> dict:
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}

    async def main():
        client = openai.AsyncOpenAI(base_url=vlm_rollout.openai_url, api_key="unused", max_retries=0, timeout=60)
        session = {"X-Session-Id": "pictures"}
        messages = [{"role": "user", "content": [{"type": "text", "text": "look "}, part(first)]}]
        one = await client.chat.completions.create(model=str(vlm_dir), messages=messages, temperature=0,
                                                   max_tokens=3, extra_headers=session)
        messages += [{"role": "assistant", "content": one.choices[0].message.content},
                     {"role": "user", "content": [part(second), {"type": "text", "text": " and now?"}]}]
        two = await client.chat.completions.create(model=str(vlm_dir), messages=messages, temperature=0,
                                                   max_tokens=3, extra_headers=session)
        async with httpx.AsyncClient(timeout=60) as http:
            closed = (await http.post(f"{vlm_rollout.openai_url}/sessions/pictures/close", json={})).json()
        return one, two, closed

    one, two, closed = asyncio.run(main())
    assert one.choices[0].message.content is not None and two.choices[0].message.content is not None
    assert [(image["grid_thw"], image["num_tokens"]) for image in closed["images"]] == [([1, 4, 6], 6), ([1, 8, 4], 8)]
    assert [image["sha256"] for image in closed["images"]] == [hashlib.sha256(d).hexdigest() for d in (first, second)]
    assert (closed["prompt_ids"] + closed["response_ids"]).count(IMAGE_PAD) == 14


def test_only_a_folder_with_a_vision_tower_gets_an_image_reader(tiny_model_dir, vlm_dir):
    # A server without a reader refuses every image part (RolloutServicer._parse: "images: this server ... takes no
    # images").
    assert ImageReader.for_model(str(tiny_model_dir), ImageSettings()) is None
    reader = ImageReader.for_model(str(vlm_dir), ImageSettings())
    assert (reader.image_token_id, reader.merge_size) == (IMAGE_PAD, 2)


def test_a_sample_keeps_its_images_on_the_wire():
    image = SampleImage(hashlib.sha256(b"x").digest(), "image/png", (1, 4, 6), 6, b"x")
    sample = Sample(sample_id="s", prompt_id="p", prompt_ids=np.arange(4, dtype=np.int32),
                    response_ids=np.arange(2, dtype=np.int32), loss_mask=np.ones(2, np.uint8),
                    rollout_logprobs=np.zeros(2, np.float32), weight_versions=np.zeros(2, np.int64), images=[image])
    assert Sample.from_proto(sample.to_proto()).images == [image]
    broken = sample.to_proto()
    del broken.images[0].grid_thw[:]
    with pytest.raises(CodecError, match=r"images\[0\].grid_thw"):
        Sample.from_proto(broken)
