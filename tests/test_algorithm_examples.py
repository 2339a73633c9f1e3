"""The algorithm examples' files, without running them (tests/test_families.py runs them): the 2-digit addition data
they train on is the quickstart project's split, byte for byte, so the two cannot drift apart."""

from pathlib import Path

from deploy.quickstart_project import write_data

DATA = Path(__file__).resolve().parents[1] / "examples" / "algorithms" / "data"


def test_the_shipped_data_is_the_quickstart_projects_split(tmp_path):
    write_data(tmp_path)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (DATA / name).read_bytes() == (tmp_path / name).read_bytes(), (
            f"examples/algorithms/data/{name} differs from deploy.quickstart_project.write_data's: write it again")
