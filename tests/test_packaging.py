"""`pip install .` ships what the code reads at run time beside its modules: the view page, the shipped experiment file,
the .proto files and the stubs' .pyi (pyproject.toml's package-data), wherever the packages put them."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "services", "rollout", "reward", "trainer", "deploy")


def test_the_wheel_carries_every_data_file_of_the_packages(tmp_path):
    tracked = subprocess.run(["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    data = {name for name in tracked if not name.endswith(".py")}
    assert "deploy/inspect/view_page/index.html" in data and "deploy/experiment/quickstart_experiment.yaml" in data
    source = tmp_path / "source"  # a copy: setuptools writes build/ and *.egg-info beside the sources
    for name in PACKAGES:
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    # setuptools is in the venv (grpcio-tools and tensorboard need it): no download, no isolated build.
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("relayrl-*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    assert not data - shipped, f"left out of the wheel: {sorted(data - shipped)}"
