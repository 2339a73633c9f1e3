"""What a run folder records about where it ran: package versions, the source revision, the seed, the command.

With the resolved config beside it (config.yaml), a run can be told apart from, or repeated as, another.
"""

import json
import pathlib
import platform
import subprocess
import sys
from importlib import metadata

PACKAGES = ("relayrl", "torch", "transformers", "grpcio", "protobuf", "numpy", "vllm", "sglang", "trl")
SOURCE = pathlib.Path(__file__).resolve().parents[2]


def git_revision(root: pathlib.Path = SOURCE) -> dict:
    """The source tree's commit and whether it has uncommitted changes; None where it is not a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10,
                                check=False)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                                capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if commit.returncode != 0:
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


def provenance(seed: int) -> dict:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"seed": seed, "command": sys.argv, "python": sys.version.split()[0], "platform": platform.platform(),
            "packages": versions, "source": git_revision()}


def write_provenance(run_dir: pathlib.Path, seed: int, resumed: bool = False) -> pathlib.Path:
    """Record where the run started; a resumed run keeps that and adds where it went on, under "resumes"."""
    path = pathlib.Path(run_dir) / "provenance.json"
    record = provenance(seed)
    if resumed and path.exists():
        record = json.loads(path.read_text())
        record.setdefault("resumes", []).append(provenance(seed))
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
