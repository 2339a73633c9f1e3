"""The fused-MoE Triton kernels' cases (tests/moe_kernel_cases.py), run in a child pytest with TRITON_INTERPRET=1 in
its environment alone when there is no GPU (as tests/test_engine_attention_triton.py runs the attention kernel's);
and the engine's choice of who runs the experts (EngineConfig.moe_backend)."""

import importlib.util
from pathlib import Path

import pytest
import torch
from test_engine_attention_triton import run_cases

from rollout.config import choose_moe_kernel

CASES = Path(__file__).with_name("moe_kernel_cases.py")
# tests/moe_kernel_cases.py: 4 (float32 shapes) + 1 (bfloat16) + 1 (padding) + 1 (engine)
EXPECTED_PASSED = 7

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

WRONG_KERNEL = """
from rollout.model import moe_triton

right = moe_triton.fused_experts
moe_triton.fused_experts = lambda *args: right(*args) * 1.001
"""


@needs_triton
def test_the_moe_kernel_cases_pass_in_a_child_process(tmp_path):
    done, outcomes = run_cases(tmp_path, cases=CASES)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    passed = [name for name, outcome in outcomes.items() if outcome == "passed"]
    assert len(passed) == EXPECTED_PASSED == len(outcomes), (outcomes, done.stdout[-3000:])


@needs_triton
def test_a_wrong_moe_kernel_fails_the_cases(tmp_path):
    (tmp_path / "wrong_moe_kernel.py").write_text(WRONG_KERNEL)
    done, outcomes = run_cases(tmp_path, "-p", "wrong_moe_kernel", "-k", "float32 and 5-64-48", cases=CASES)
    assert done.returncode == 1, done.stdout[-6000:] + done.stderr[-2000:]
    assert list(outcomes.values()) == ["failure"], outcomes


def test_auto_runs_the_experts_in_torch_on_cpu_and_a_named_kernel_says_why_it_cannot(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert choose_moe_kernel("auto", cpu) == "torch" and choose_moe_kernel("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="moe_backend 'triton': .*runs on CUDA devices"):
        choose_moe_kernel("triton", cpu)
    with pytest.raises(ValueError, match="moe_backend: 'cutlass' is not one of"):
        choose_moe_kernel("cutlass", cpu)


@pytest.mark.gpu
def test_on_cuda_the_compiled_moe_kernels_equal_the_torch_experts(tmp_path):
    """On CUDA the child runs the compiled kernels: the bfloat16 case multiplies in bfloat16 (UPCAST off: under the
    interpreter the dots run in float32, so only a GPU checks it), and the engine on the kernels generates as on torch."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    done, outcomes = run_cases(tmp_path, cases=CASES)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert set(outcomes.values()) == {"passed"} and len(outcomes) == EXPECTED_PASSED, outcomes
