"""The run folder's provenance.json: package versions, the source tree's revision, the seed and command."""

import json
import subprocess

from deploy.record.provenance import git_revision, write_provenance


def test_provenance_records_versions_revision_and_seed(tmp_path):
    record = json.loads(write_provenance(tmp_path, seed=7).read_text())
    assert record["seed"] == 7 and record["python"].count(".") == 2
    assert record["packages"]["torch"] and record["packages"]["relayrl"]
    assert set(record["source"]) == {"commit", "dirty"}


def test_git_revision_of_a_checkout_and_of_a_plain_folder(tmp_path):
    assert git_revision(tmp_path) == {"commit": None, "dirty": None}  # not a git checkout
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (repo / "f.txt").write_text("a")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert git_revision(repo) == {"commit": head, "dirty": False}
    (repo / "f.txt").write_text("b")
    assert git_revision(repo) == {"commit": head, "dirty": True}
