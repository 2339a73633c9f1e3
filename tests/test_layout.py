"""The house's rules, checked: import contracts (import-linter, pyproject.toml), no import circles, small modules."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "services", "rollout", "reward", "trainer", "deploy")
SOURCE_FOLDERS = (*PACKAGES, "tests", "bench", "examples", "scripts")
MAX_LINES = 400
LINT_IMPORTS = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")

needs_linter = pytest.mark.skipif(LINT_IMPORTS is None, reason="import-linter is not installed (the dev extra)")


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([LINT_IMPORTS, "--config", str(tree / "pyproject.toml"), "--no-cache"], check=False,
                          cwd=tree, env=env,
                          capture_output=True, text=True, timeout=120)


def _copy_tree(dest: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")
    return dest


@needs_linter
def test_the_import_contracts_hold():
    done = _lint_imports(ROOT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in done.stdout


@needs_linter
def test_a_circle_added_on_purpose_breaks_the_check(tmp_path):
    tree = _copy_tree(tmp_path)
    codecs = tree / "rollout" / "kv" / "codecs.py"  # rollout/kv/quantized.py imports it: import it back
    codecs.write_text(codecs.read_text() + "\nfrom rollout.kv import quantized  # noqa: E402,F401  a circle\n")
    done = _lint_imports(tree)
    assert done.returncode == 1, done.stdout[-4000:]
    assert "No cycles are allowed in rollout.kv" in done.stdout


@needs_linter
def test_an_import_running_back_up_breaks_the_check(tmp_path):
    tree = _copy_tree(tmp_path)
    engine = tree / "rollout" / "engine" / "llm_engine.py"  # the engine's core must not know its service
    engine.write_text(engine.read_text() + "\nfrom rollout.serve import wire  # noqa: E402,F401  upwards\n")
    done = _lint_imports(tree)
    assert done.returncode == 1, done.stdout[-4000:]
    assert "rollout.engine.llm_engine -> rollout.serve.wire" in done.stdout



@needs_linter
def test_an_import_running_back_up_in_deploy_breaks_the_check(tmp_path):
    tree = _copy_tree(tmp_path)
    schema = tree / "deploy" / "experiment" / "schema.py"  # the experiment file must not know the runs made of it
    schema.write_text(schema.read_text() + "\nfrom deploy.runs import experiment_run  # noqa: E402,F401  upwards\n")
    done = _lint_imports(tree)
    assert done.returncode == 1, done.stdout[-4000:]
    assert "deploy.experiment is not allowed to import deploy.runs" in done.stdout


def test_deploy_is_packages_by_job():
    """Every module of deploy/ but its entry points lives in a package named for its job (the floors in
    pyproject.toml), so a newcomer finds the launcher, the experiment file or the doctor by folder name."""
    loose = sorted(p.name for p in (ROOT / "deploy").glob("*.py") if p.name not in ("__init__.py", "__main__.py", "cli.py"))
    assert not loose, f"modules outside deploy's packages: {loose}"
    tracked = set(subprocess.run(["git", "ls-files", "deploy"], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.split())
    folders = {str(Path(name).parent) for name in tracked if name.endswith(".py")}
    untracked = sorted(f"{folder}/__init__.py" for folder in folders if f"{folder}/__init__.py" not in tracked)
    assert not untracked, f"packages whose __init__.py git does not track (.gitignore?): {untracked}"

def test_no_module_is_over_400_lines():
    long = []
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" in path.name or "node_modules" in path.parts:
                continue
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                long.append(f"{path.relative_to(ROOT)}: {lines}")
    assert not long, f"modules over {MAX_LINES} lines (split them by concern): {long}"
