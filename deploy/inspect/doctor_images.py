"""`relayrl doctor`'s checks of an experiment's images (data.image_field): the model has a vision tower and an image
processor that loads, and every row's image exists (a path relative to the data file, or base64) and decodes."""

import base64
import io
import json
import pathlib

from deploy.experiment.data import DataError, image_base64, read_rows
from deploy.experiment.schema import ExperimentConfig
from deploy.inspect.findings import Finding


def check_images(config: ExperimentConfig, findings: list[Finding]) -> None:
    data = config.data
    if data is None or data.image_field is None:
        return
    problem = _model_problem(config)
    if problem is not None:
        findings.append(problem)
        return
    for name, source in (("train", data.train), ("eval", data.eval)):
        if source is None:
            continue
        try:
            rows = read_rows(source)
        except DataError:
            continue  # check_data says why
        bad = [problem for number, row in enumerate(rows) if data.image_field in row
               and (problem := _unreadable(row[data.image_field], pathlib.Path(source.path).parent,
                                           f"{name} row {number}"))]
        if bad:
            findings.append(Finding("error", f"images ({name})", f"{len(bad)} of {len(rows)} images do not read, e.g. "
                                    f"{bad[0]}", "fix the paths (relative to the data file) or the base64 bytes"))
        else:
            findings.append(Finding("ok", f"images ({name})", f"{len(rows)} images exist and decode"))


def _model_problem(config: ExperimentConfig) -> Finding | None:
    """Why the model cannot take images (no vision tower, or an image processor that does not load); None if it can.
    A tiny model built in code (model.tiny) has a tower with arch qwen2_5_vl, and the kit writes its processor."""
    tiny = config.model.tiny
    if tiny is not None:
        if tiny.arch == "qwen2_5_vl":
            return None
        return Finding("error", "images", f"data.image_field is set but model.tiny.arch {tiny.arch} has no vision "
                       "tower", "set model.tiny.arch: qwen2_5_vl, or unset data.image_field")
    model = pathlib.Path(config.model.path or "")
    model_config = model / "config.json"
    if not model_config.exists() or "vision_config" not in json.loads(model_config.read_text()):
        return Finding("error", "images", f"data.image_field is set but the model {model} has no vision tower (its "
                       "config.json has no vision_config)",
                       "train a vision-language model (model_type qwen2_5_vl), or unset data.image_field")
    try:
        from transformers import AutoImageProcessor

        AutoImageProcessor.from_pretrained(model)
    except (OSError, ValueError, ImportError) as exc:
        return Finding("error", "images", f"the image processor of {model} does not load: {exc}",
                       "save one there (e.g. Qwen2VLImageProcessorPil(...).save_pretrained(model folder))")
    return None


def _unreadable(value, root: pathlib.Path, where: str) -> str:
    """Why a row's image does not read ("" when it does)."""
    from PIL import Image, UnidentifiedImageError

    try:
        encoded = image_base64(value, root, where)
        Image.open(io.BytesIO(base64.b64decode(encoded))).verify()
    except DataError as exc:
        return str(exc)
    except (UnidentifiedImageError, OSError, SyntaxError) as exc:  # Pillow's verify raises SyntaxError on bad bytes
        return f"{where}: not an image Pillow decodes ({exc})"
    return ""
