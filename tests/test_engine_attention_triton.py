"""The Triton paged-attention kernel's cases (tests/triton_kernel_cases.py), run in a child pytest.

Without CUDA the kernel runs in Triton's interpreter, switched on by TRITON_INTERPRET=1 before triton is first
imported. In the pytest process that cannot be arranged (torch._dynamo, which FSDP and DCP import, imports triton
in any full run; turned on only around the kernel's import, triton then refused the kernel: "Cannot call
@triton.jit'd outside of the scope of a kernel"), and exported for the whole session every process a later test
started inherited it: torchrun ranks importing triton in interpreter mode aborted at exit in 2 of 10 runs. So the
child alone has it, from its start, whatever this process imported before. With CUDA the child runs the compiled
kernel, without the variable.
"""

import importlib.util
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
CASES = Path(__file__).with_name("triton_kernel_cases.py")
# tests/triton_kernel_cases.py: 6 (dtype x cache) + 1 (multi-head) + 2 (engine, cuda_graphs) + 1 (the choice) + 2 (tiles
# past a chunk) + 3 (split decode) + 1 (the split rule)
EXPECTED_PASSED = 16

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)


# A pytest plugin for the child: the kernel's output off by 1% (as a wrong kernel's would be), loaded before the cases
WRONG_KERNEL = """
from rollout.model import attention_triton

right = attention_triton.paged_attention_triton
attention_triton.paged_attention_triton = lambda *args: right(*args) * 1.01
"""


def run_cases(tmp_path: Path, *args: str, cases: Path = CASES) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    """Run the cases in a child pytest, TRITON_INTERPRET=1 in its environment alone when there is no CUDA; tmp_path
    leads its PYTHONPATH. Returns the child's result and each case's outcome (passed, failure, error, skipped)
    read from its JUnit report."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), env.get("PYTHONPATH")]))
    report = tmp_path / "cases.xml"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}",
                           *args, str(cases)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=540,
                          check=False)
    assert report.exists(), done.stdout[-6000:] + done.stderr[-2000:]
    outcomes = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        found = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[case.get("name")] = found[0] if found else "passed"
    return done, outcomes


def test_the_kernel_cases_pass_in_a_child_process(tmp_path):
    """Every case ran and passed: a skipped or missing case fails this as a failed one does."""
    done, outcomes = run_cases(tmp_path)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    passed = [name for name, outcome in outcomes.items() if outcome == "passed"]
    assert len(passed) == EXPECTED_PASSED == len(outcomes), (outcomes, done.stdout[-3000:])


def test_a_wrong_kernel_fails_the_cases(tmp_path):
    """The child's cases can fail, and a failure reaches this process: with the kernel's output off by 1% the
    float32 comparison (within 1e-5) fails. One case, to keep it short."""
    (tmp_path / "wrong_kernel.py").write_text(WRONG_KERNEL)
    done, outcomes = run_cases(tmp_path, "-p", "wrong_kernel", "-k", "over_decodes_and_prefill_chunks and float32-auto")
    assert done.returncode == 1, done.stdout[-6000:] + done.stderr[-2000:]
    assert outcomes == {"test_the_kernel_equals_the_torch_path_over_decodes_and_prefill_chunks[float32-auto]":
                        "failure"}, outcomes
    assert "Mismatched elements" in done.stdout, done.stdout[-3000:]


def test_no_triton_interpret_in_the_test_process():
    """TRITON_INTERPRET=1 in the pytest process is inherited by every process a test starts (services, torchrun
    ranks): it belongs to the child above alone. If this fails from a shell that exported it, unset it there."""
    assert "TRITON_INTERPRET" not in os.environ, "TRITON_INTERPRET is set in the pytest process"


@pytest.mark.gpu
def test_on_cuda_the_compiled_kernel_equals_the_torch_path_in_bfloat16_and_split(tmp_path):
    """On CUDA the child runs the compiled kernel: its bfloat16 variant multiplies in bfloat16 (UPCAST off: under the
    interpreter the dots always run in float32, so only a GPU checks it), within 1e-2 of the torch path in bfloat16;
    the split-K decode and its merge; the engines on the kernel with and without CUDA graphs."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    done, outcomes = run_cases(tmp_path, "-k", "bfloat16 or split or an_engine_on_the_kernel or tiles_past")
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert sum("bfloat16" in name for name in outcomes) == 4, outcomes
    assert set(outcomes.values()) == {"passed"} and len(outcomes) >= 10, outcomes
