"""The Triton kernel compiles for a Hopper GPU (sm_90: H100, H200) without one: Triton's own compiler and the ptxas
its wheel carries build the cubin on a CPU machine. The interpreter tests (tests/test_engine_attention_triton.py) check
what the kernel computes; this checks that the compiled variants the engine launches on CUDA build at all (tl.dot's
shapes, the dynamic loop, the int4 unpacking, bfloat16 and float32). In a subprocess: the interpreter switch is
process-wide, and this needs it off."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

SCRIPT = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout.model.attention_triton import _paged_attention as kernel

def signature(bits, dtype, upcast, block_q, group, block_size, head_dim):
    quantized = {"open_slot_ptr": "*i64", "key_mins_ptr": "*fp16", "key_scales_ptr": "*fp16",
                 "value_mins_ptr": "*fp16", "value_scales_ptr": "*fp16", "k_codes_ptr": "*u8", "v_codes_ptr": "*u8"}
    pointers = {name: f"*{dtype}" for name in ("q_ptr", "out_ptr", "k_ptr", "v_ptr", *quantized)}
    pointers.update(tables_ptr="*i32", query_starts_ptr="*i32", context_lens_ptr="*i64", scale="fp32")
    if bits:
        pointers.update(quantized)
    constants = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                     BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=max(16, triton.next_power_of_2(block_q * group)),
                     BLOCK_N=32, BITS=bits, VALUE_GROUP=32 if head_dim % 32 == 0 else head_dim, UPCAST=upcast,
                     PRECISION="ieee" if upcast else None)
    names = kernel.arg_names
    types = {name: pointers.get(name, "constexpr" if name in constants else "i32") for name in names}
    return types, {(names.index(name),): value for name, value in constants.items()}

# (bits, dtype, float32 dot, queries per program, query heads per kv head, block size, head_dim): a decode step of a
# Qwen2.5-0.5B-shaped model in bfloat16, a prefill chunk on an int4 cache, a float32 decode on int8 blocks of 16
for case in [(0, "bf16", False, 1, 7, 16, 64), (4, "bf16", False, 16, 7, 16, 64), (8, "fp32", True, 1, 2, 16, 128)]:
    types, constants = signature(*case)
    compiled = triton.compile(ASTSource(fn=kernel, signature=types, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], case
    print("compiled", case)
"""


def test_the_kernel_compiles_for_sm90():
    ptxas = Path(pytest.importorskip("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"no ptxas in the triton wheel ({ptxas})")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, said aloud (it warns otherwise)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == 3, result.stdout
