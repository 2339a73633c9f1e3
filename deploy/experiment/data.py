"""An experiment's data: rows read from JSONL / Parquet / a `datasets` folder, mapped to the driver's prompts.

The driver reads {prompt_id, prompt, metadata} per line (rollout/driver/driver.py) and encodes `prompt` as it is; so a
chat template is applied here, once, and the rendered text is what the driver encodes.
"""

import base64
import binascii
import json
import pathlib
import random
from dataclasses import dataclass

from deploy.experiment.schema import DataSection, DataSource

# How a prompt holds its image (Qwen2.5-VL's tokens): the rollout expands the pad to the image's tokens.
IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


class DataError(ValueError):
    """The data cannot be read or lacks a field the experiment names; the message says which and the fix."""


@dataclass(frozen=True)
class PromptRow:
    """One prompt as the driver and the evaluation take it."""

    prompt_id: str
    prompt: str  # the text the driver encodes (rendered through the chat template when asked)
    metadata: dict  # what the reward reads: answer and the metadata fields (a DPO pair: answer = chosen, rejected)
    images: tuple[str, ...] = ()  # base64 encoded images, one per image placeholder in `prompt` (data.image_field)


def source_format(source: DataSource) -> str:
    if source.format != "auto":
        return source.format
    path = pathlib.Path(source.path)
    if path.is_dir():
        return "datasets"
    return "parquet" if path.suffix == ".parquet" else "jsonl"


def read_rows(source: DataSource) -> list[dict]:
    """Every row of a data source, as dicts."""
    path = pathlib.Path(source.path)
    if not path.exists():
        raise DataError(f"data path {path} does not exist: write the data there or fix the path")
    kind = source_format(source)
    if kind == "jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{number}: not JSON ({exc.msg}): one JSON object per line") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{number}: a {type(row).__name__}, not a JSON object")
            rows.append(row)
        return rows
    if kind == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or convert it to JSONL") from None
        return pq.read_table(path).to_pylist()
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a datasets folder needs the `datasets` package (pip install datasets), "
                        "or export it to JSONL") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if source.split is None or source.split not in loaded:
            raise DataError(f"{path}: a DatasetDict with splits {sorted(loaded)}: set data.*.split to one of them")
        loaded = loaded[source.split]
    return list(loaded)


def missing_fields(rows: list[dict], data: DataSection) -> dict[str, int]:
    """field -> how many rows lack it, for each field the experiment names."""
    named = [data.prompt_field, data.answer_field, data.id_field, *data.metadata_fields, data.chosen_field,
             data.rejected_field, data.image_field]
    return {name: sum(name not in row for row in rows) for name in named
            if name is not None and any(name not in row for row in rows)}


def to_prompts(rows: list[dict], data: DataSection, tokenizer, where: str,
               root: pathlib.Path | None = None) -> list[PromptRow]:
    """Map rows to prompts: the prompt (rendered through the chat template when asked), answer and metadata, and the
    row's image (data.image_field: a path relative to `root`, the data file's folder, or base64)."""
    missing = missing_fields(rows, data)
    if missing:
        name, count = next(iter(missing.items()))
        raise DataError(f"{where}: {count} of {len(rows)} rows have no field {name!r} (fields of the first row: "
                        f"{sorted(rows[0]) if rows else []}): set data.*_field to the right name")
    prompts = []
    for number, row in enumerate(rows):
        text = str(row[data.prompt_field])
        images = ()
        if data.image_field is not None:
            images = (image_base64(row[data.image_field], root or pathlib.Path("."), f"{where} row {number}"),)
            text = text if IMAGE_PLACEHOLDER in text else IMAGE_PLACEHOLDER + text
        if data.chat_template:
            messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
            messages.append({"role": "user", "content": text})
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        metadata = {name: row[name] for name in data.metadata_fields}
        if data.answer_field is not None:
            metadata["answer"] = row[data.answer_field]
        if data.chosen_field is not None:  # a preference pair (DPO): the chosen response is the answer
            metadata.update(answer=row[data.chosen_field], rejected=row[data.rejected_field])
        prompt_id = str(row[data.id_field]) if data.id_field else f"{where}-{number}"
        prompts.append(PromptRow(prompt_id, text, metadata, images))
    return prompts


def image_base64(value, root: pathlib.Path, where: str) -> str:
    """A row's image as base64: read from a path under `root` (relative to the data file), else taken as base64
    already; DataError says which when it is neither a file nor base64."""
    path = root / str(value)
    if isinstance(value, str) and len(value) < 4096 and path.is_file():
        return base64.b64encode(path.read_bytes()).decode()
    try:
        base64.b64decode(str(value), validate=True)
    except binascii.Error:
        raise DataError(f"{where}: image {str(value)[:60]!r} is neither a file under {root} nor base64") from None
    return str(value)


def split(data: DataSection, tokenizer, seed: int) -> tuple[list[PromptRow], list[PromptRow]]:
    """(train, held-out eval) prompts: every row of an eval source (its first num_eval when set); without one,
    num_eval rows (64 unless set) of train held out by a seeded shuffle."""
    train = to_prompts(read_rows(data.train), data, tokenizer, "train", pathlib.Path(data.train.path).parent)
    if data.eval is not None:
        held_out = to_prompts(read_rows(data.eval), data, tokenizer, "eval", pathlib.Path(data.eval.path).parent)
        return train, held_out[:data.eval_count(len(held_out))]
    count = data.eval_count(len(train))
    if len(train) <= count:
        raise DataError(f"data.num_eval={count} holds out every one of the {len(train)} train rows: "
                        "lower it or give data.eval")
    order = list(train)
    random.Random(seed).shuffle(order)
    return order[count:], order[:count]


def write_prompts(prompts: list[PromptRow], path: pathlib.Path) -> pathlib.Path:
    """The driver's prompt file."""
    with open(path, "w") as out:
        out.writelines(json.dumps({"prompt_id": row.prompt_id, "prompt": row.prompt, "metadata": row.metadata,
                                   **({"images": list(row.images)} if row.images else {})}) + "\n" for row in prompts)
    return path


def prompt_ids(row: PromptRow, tokenizer, add_bos: bool) -> list[int]:
    """The token ids the driver makes of a prompt (rollout.driver.driver.load_prompts), for evaluation."""
    ids = tokenizer.encode(row.prompt, add_special_tokens=False)
    if add_bos and tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id, *ids]
    return ids


def main(path: str) -> int:
    """`python -m deploy.experiment.data EXPERIMENT.yaml`: the driver's prompt file, RUN_DIR/prompts.jsonl, from the
    experiment's data (its train split: the rows not held out). The Kubernetes driver's init container runs it."""
    from transformers import AutoTokenizer

    from deploy.experiment.schema import load_experiment

    config = load_experiment(path)
    tokenizer = AutoTokenizer.from_pretrained(config.model.path)
    train, _ = split(config.data, tokenizer, config.seed)
    run_dir = pathlib.Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"{len(train)} prompts -> {write_prompts(train, run_dir / 'prompts.jsonl')}")
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1]))
