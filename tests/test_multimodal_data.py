"""An experiment's image data: data.image_field (a path relative to the data file, or base64) reaches the driver's
prompt file as base64 with the image placeholder in the prompt; the driver reads it back as image bytes and token
ids with one image-token placeholder; bad values are refused by row."""

import base64
import io
import json

import pytest
from PIL import Image

from deploy.experiment.data import IMAGE_PLACEHOLDER, DataError, split, write_prompts
from deploy.experiment.schema import DataSection
from rollout.driver.driver import DriverConfig, load_prompts
from rollout.model.tiny import char_tokenizer
from rollout.model.tiny_vlm import IMAGE_PAD, add_vision_tokens


def png_bytes(color) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (56, 56), color).save(out, "PNG")
    return out.getvalue()


def test_image_rows_reach_the_driver_as_image_parts(tmp_path):
    (tmp_path / "data" / "pics").mkdir(parents=True)  # paths are relative to the data file
    (tmp_path / "data" / "pics" / "red.png").write_bytes(png_bytes((255, 0, 0)))
    inline = base64.b64encode(png_bytes((0, 0, 255))).decode()
    rows = [{"prompt": "what color?", "answer": "red", "image": "pics/red.png"},
            {"prompt": f"{IMAGE_PLACEHOLDER} and this?", "answer": "blue", "image": inline}]
    data_file = tmp_path / "data" / "train.jsonl"
    data_file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = DataSection.model_validate({"train": {"path": str(data_file)}, "image_field": "image", "num_eval": 1})
    tokenizer = add_vision_tokens(char_tokenizer())
    train, held_out = split(data, tokenizer, seed=0)
    prompts = {row.metadata["answer"]: row for row in train + held_out}
    assert prompts["red"].prompt == IMAGE_PLACEHOLDER + "what color?"  # placed before the text
    assert prompts["blue"].prompt == rows[1]["prompt"]  # it held one already
    assert base64.b64decode(prompts["red"].images[0]) == png_bytes((255, 0, 0))
    tokenizer.save_pretrained(tmp_path / "tok")
    prompt_file = write_prompts(list(prompts.values()), tmp_path / "prompts.jsonl")
    loaded = load_prompts(DriverConfig.model_validate({
        "rollout": "127.0.0.1:1", "reward": "127.0.0.1:2", "buffer": "127.0.0.1:3",
        "tokenizer": str(tmp_path / "tok"), "prompts": str(prompt_file)}))
    for prompt in loaded:
        assert prompt.ids.count(tokenizer.convert_tokens_to_ids(IMAGE_PAD)) == 1 and len(prompt.images) == 1
    assert {p.images[0] for p in loaded} == {png_bytes((255, 0, 0)), png_bytes((0, 0, 255))}


def test_an_image_that_is_neither_a_file_nor_base64_is_refused_by_row(tmp_path):
    data_file = tmp_path / "train.jsonl"
    data_file.write_text(json.dumps({"prompt": "x", "answer": "y", "image": "no such file.png"}) + "\n"
                         + json.dumps({"prompt": "x", "answer": "y"}) + "\n")
    data = DataSection.model_validate({"train": {"path": str(data_file)}, "image_field": "image", "num_eval": 1})
    with pytest.raises(DataError, match="have no field 'image'"):
        split(data, None, seed=0)
    data_file.write_text(json.dumps({"prompt": "x", "answer": "y", "image": "no such file.png"}) + "\n")
    with pytest.raises(DataError, match="train row 0: image 'no such file.png' is neither a file"):
        split(data.model_copy(update={"eval": data.train}), None, seed=0)


def test_the_doctor_checks_the_images_and_the_processor(tmp_path):
    import yaml

    from deploy.inspect.doctor import diagnose
    from rollout.model.tiny import write_tiny_model

    text_model = write_tiny_model(tmp_path / "text")
    vlm = write_tiny_model(tmp_path / "vlm", arch="qwen2_5_vl")
    (tmp_path / "ok.png").write_bytes(png_bytes((0, 255, 0)))
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    rows = [{"prompt": "a", "answer": "b", "image": name} for name in ("ok.png", "ok.png", "broken.png")]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    def findings(model) -> dict[str, tuple[str, str]]:
        path = tmp_path / "experiment.yaml"
        path.write_text(yaml.safe_dump({"model": {"path": str(model)}, "data": {
            "train": {"path": str(tmp_path / "train.jsonl")}, "image_field": "image", "num_eval": 1}}))
        return {f.check: (f.level, f.message) for f in diagnose(path) if f.check.startswith("images")}

    assert findings(text_model)["images"][0] == "error" and "no vision tower" in findings(text_model)["images"][1]
    level, message = findings(vlm)["images (train)"]
    assert level == "error" and message.startswith("1 of 3 images do not read, e.g. train row 2")
    (tmp_path / "broken.png").write_bytes(png_bytes((1, 2, 3)))
    assert findings(vlm)["images (train)"] == ("ok", "3 images exist and decode")


def test_the_doctor_takes_a_tiny_vision_language_model_built_in_code(tmp_path):
    # model.tiny has no folder to read before the run writes it: its arch says whether it has a vision tower (before,
    # every model.tiny was "the model . has no vision tower", examples/multimodal/digits.yaml's too).
    import yaml

    from deploy.inspect.doctor import diagnose

    (tmp_path / "ok.png").write_bytes(png_bytes((0, 255, 0)))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "a", "answer": "b", "image": "ok.png"}) + "\n")

    def findings(arch: str) -> dict[str, tuple[str, str]]:
        path = tmp_path / "experiment.yaml"
        path.write_text(yaml.safe_dump({"model": {"tiny": {"arch": arch}}, "data": {
            "train": {"path": str(tmp_path / "train.jsonl")}, "image_field": "image", "num_eval": 1}}))
        return {f.check: (f.level, f.message) for f in diagnose(path) if f.check.startswith("images")}

    assert findings("qwen2_5_vl") == {"images (train)": ("ok", "1 images exist and decode")}
    level, message = findings("qwen2")["images"]
    assert level == "error" and "model.tiny.arch qwen2 has no vision tower" in message


def test_the_sft_warm_up_sees_the_rows_images(tmp_path):
    from transformers import AutoTokenizer

    from deploy.experiment.data import PromptRow
    from deploy.runs.experiment_run import _sft_samples
    from rollout.model.tiny import write_tiny_model

    vlm = write_tiny_model(tmp_path / "vlm", arch="qwen2_5_vl")
    tokenizer = AutoTokenizer.from_pretrained(vlm)
    image = base64.b64encode(png_bytes((9, 9, 9))).decode()  # 56 x 56: 4 image tokens
    rows = [PromptRow("p0", IMAGE_PLACEHOLDER + "what?", {"answer": "grey"}, (image,)),
            PromptRow("p1", "no image", {"answer": "x"})]
    with_image, without = _sft_samples(rows, tokenizer, True, vlm)
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert int((with_image.prompt_ids == pad).sum()) == with_image.images[0].num_tokens == 4
    assert with_image.images[0].data == png_bytes((9, 9, 9)) and with_image.images[0].grid_thw == (1, 4, 4)
    assert without.images == [] and pad not in without.prompt_ids
