"""An experiment's data in each format it accepts: the same rows as JSONL, Parquet and a `datasets` folder saved
with save_to_disk (a Dataset, and a DatasetDict with its split named) become the same prompts and the same
held-out split; `relayrl doctor` reads each, and names a split that is not there."""

import json

import pytest
from transformers import AutoTokenizer
from user_project import write_data, write_model

from deploy.experiment.data import DataError, read_rows, split
from deploy.experiment.schema import DataSection
from deploy.inspect.doctor import main as doctor

FIELDS = {"prompt_field": "question", "answer_field": "label", "id_field": "id", "num_eval": 16}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("data-formats")
    rows = [json.loads(line) for line in write_data(folder / "data.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), folder / "data.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(folder / "dataset"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:100]),
                          "test": datasets.Dataset.from_list(rows[100:])}).save_to_disk(str(folder / "dataset-dict"))
    write_model(folder / "model")
    return folder


@pytest.mark.parametrize("source", [{"path": "data.parquet"}, {"path": "dataset"},
                                    {"path": "data.parquet", "format": "parquet"}])
def test_parquet_and_datasets_folders_read_as_the_jsonl_does(folder, source):
    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    reference = DataSection(train={"path": str(folder / "data.jsonl")}, **FIELDS)
    other = DataSection(train={**source, "path": str(folder / source["path"])}, **FIELDS)
    assert read_rows(other.train) == read_rows(reference.train)
    assert split(other, tokenizer, seed=0) == split(reference, tokenizer, seed=0)


def test_a_dataset_dict_is_read_by_its_split(folder):
    rows = read_rows(DataSection(train={"path": str(folder / "dataset-dict"), "split": "test"}, **FIELDS).train)
    everything = [json.loads(line) for line in (folder / "data.jsonl").read_text().splitlines()]
    assert rows == everything[100:]
    with pytest.raises(DataError, match=r"splits \['test', 'train'\]: set data.\*.split"):
        read_rows(DataSection(train={"path": str(folder / "dataset-dict")}, **FIELDS).train)


def test_doctor_reads_a_parquet_experiment_and_names_a_missing_split(folder, capsys):
    import yaml

    experiment = {"model": {"path": "model"}, "data": {"train": {"path": "data.parquet"},
                                                       "eval": {"path": "dataset-dict", "split": "test"}, **FIELDS}}
    path = folder / "experiment.yaml"
    path.write_text(yaml.safe_dump(experiment))
    assert doctor(str(path), ["reward.function=exact_match"]) == 0, capsys.readouterr().out
    capsys.readouterr()
    assert doctor(str(path), ["data.eval.split=validation"]) == 1
    assert "set data.*.split" in capsys.readouterr().out
