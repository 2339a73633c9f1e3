"""scripts/gpu_check.sh, the project's GPU smoke check, run end to end as its dry run on a CPU (`--device cpu`: tiny
shapes, short budgets): one verdict line per step, a summary that counts them, the logs under $OUT."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEPS = {"env", "vllm", "sglang", "flashinfer", "gpu-tests", "engine-bench", "logprob-mismatch", "trainer-step",
         "quickstart"}
VERDICT = re.compile(r"^verdict: (\S+) (PASS|FAIL|SKIP) \((.*)\)$")


def summary_text(out: pathlib.Path) -> str:
    return (out / "summary.txt").read_text()


def test_bad_arguments_are_refused_and_help_shows_the_steps():
    bad = subprocess.run(["bash", str(SCRIPT), "--device", "tpu"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert bad.returncode == 2 and "--device is cuda or cpu" in bad.stderr
    usage = subprocess.run(["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30, check=False)
    assert usage.returncode == 0 and all(step in usage.stdout for step in ("gpu-tests", "logprob-mismatch",
                                                                          "trainer-step", "quickstart"))


@pytest.mark.extended
@pytest.mark.timeout(600)
def test_the_dry_run_on_cpu_runs_every_step_with_one_verdict_each(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PY": sys.executable, "OUT": str(out), "WORK": str(tmp_path / "work"), "QS_RL_S": "40",
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", str(SCRIPT), "--device", "cpu"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=570, check=False)
    lines = run.stdout.splitlines()
    verdicts = {m[1]: (m[2], m[3]) for m in map(VERDICT.match, lines) if m}
    assert set(verdicts) == STEPS, run.stdout[-4000:]
    assert run.returncode == 0, run.stdout[-4000:]
    assert verdicts["env"][0] == "PASS" and "0 broken" in verdicts["env"][1]
    for optional in ("vllm", "sglang", "flashinfer"):
        status, why = verdicts[optional]
        assert (status, "not importable") == ("SKIP", why[:14]) or (status == "PASS" and "importable" in why)
    if not torch.cuda.is_available():
        assert verdicts["gpu-tests"][0] == "SKIP" and "needs a CUDA GPU" in verdicts["gpu-tests"][1]
    assert verdicts["engine-bench"][0] == ("PASS" if (ROOT / "bench" / "engine_gpu.py").exists() else "SKIP")
    assert verdicts["logprob-mismatch"][0] == "PASS" and "bf16_default_abs_mean" in verdicts["logprob-mismatch"][1]
    assert verdicts["trainer-step"][0] == "PASS" and "trainer_step_vs_plain_torch" in verdicts["trainer-step"][1]
    assert verdicts["quickstart"][0] == "PASS" and " steps, " in verdicts["quickstart"][1]
    counts = {status: sum(v[0] == status for v in verdicts.values()) for status in ("PASS", "FAIL", "SKIP")}
    assert re.fullmatch(rf"summary: {counts['PASS']} PASS, 0 FAIL, {counts['SKIP']} SKIP in \d+s \(device cpu; logs in "
                        rf"{re.escape(str(out))}\)", lines[-1])
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line for line in summary if VERDICT.match(line)] == [line for line in lines if VERDICT.match(line)]
    if not torch.cuda.is_available():  # every gpu test listed with its outcome
        assert "SKIP tests/test_engine_cuda_graphs.py::test_bfloat16_by_default_on_cuda" in summary_text(out)
    for log in ("env", "gpu-tests", "logprob-mismatch", "trainer-step", "quickstart"):
        assert (out / f"{log}.log").stat().st_size > 0
