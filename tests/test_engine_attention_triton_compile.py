"""The Triton kernel compiles for a Hopper GPU (sm_90: H100, H200) without one: Triton's own compiler and the ptxas
its wheel carries build the cubin on a CPU machine. The interpreter tests (tests/test_engine_attention_triton.py) check
what the kernel computes; this checks that the compiled variants the engine launches on CUDA build at all (tl.dot's
shapes, the dynamic loop, the int4 unpacking, bfloat16 and float32, split-K decode and its merge), and with the tile
sizes and warps of attention_triton.launch_shape none spills registers (ptxas -v; issue 34: query tiles of 16 x a
group of 8 at head_dim 128 spilled 700 bytes). In a subprocess: the interpreter switch is process-wide, and this
needs it off."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

SCRIPT = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout.model.attention_triton import _combine_splits, _paged_attention as kernel, launch_shape

def compile_logged(fn, types, constants, num_warps):
    compiled = triton.compile(ASTSource(fn=fn, signature=types, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})
    assert compiled.asm["cubin"]
    return compiled

def signature(bits, dtype, decode, group, head_dim, split):
    upcast = dtype == "fp32"
    shape = launch_shape(decode, group, head_dim, bits, upcast)
    quantized = {"open_slot_ptr": "*i64", "key_mins_ptr": "*fp16", "key_scales_ptr": "*fp16",
                 "value_mins_ptr": "*fp16", "value_scales_ptr": "*fp16", "k_codes_ptr": "*u8", "v_codes_ptr": "*u8"}
    pointers = {name: f"*{dtype}" for name in ("q_ptr", "out_ptr", "k_ptr", "v_ptr", *quantized)}
    pointers.update(tables_ptr="*i32", query_starts_ptr="*i32", context_lens_ptr="*i64", scale="fp32",
                    part_stats_ptr="*fp32", part_acc_ptr="*fp32")
    if bits:
        pointers.update(quantized)
    constants = dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_D=shape.block_d, BLOCK_SIZE=16, BLOCK_Q=shape.block_q,
                     BLOCK_M=shape.block_m, BLOCK_N=shape.block_n, BITS=bits,
                     VALUE_GROUP=32 if head_dim % 32 == 0 else head_dim, UPCAST=upcast,
                     PRECISION="ieee" if upcast else None, SPLIT=split)
    names = kernel.arg_names
    types = {name: pointers.get(name, "constexpr" if name in constants else "i32") for name in names}
    return types, {(names.index(name),): value for name, value in constants.items()}, shape.num_warps

# (bits, dtype, decode, query heads per kv head, head_dim, split-K): Qwen2.5-0.5B's shape (7 heads per kv head of 64)
# in bfloat16 decoding (split and not) and prefilling; 8 per kv head at head_dim 128 and 256 (Llama/Qwen3-like);
# quantized caches; float32.
CASES = [(0, "bf16", True, 7, 64, False), (0, "bf16", True, 7, 64, True), (0, "bf16", False, 7, 64, False),
         (0, "bf16", False, 8, 128, False), (0, "bf16", True, 8, 128, True), (0, "bf16", False, 8, 256, False),
         (4, "bf16", False, 7, 64, False), (4, "bf16", True, 8, 128, True), (8, "bf16", False, 8, 128, False),
         (8, "fp32", True, 2, 128, False), (0, "fp32", False, 8, 128, False)]
for case in CASES:
    compile_logged(kernel, *signature(*case))
    print("compiled", case, flush=True)
types = {name: "constexpr" if name.isupper() else ("*fp32" if name.endswith("ptr") else "i32")
         for name in _combine_splits.arg_names}
types.update(out_ptr="*bf16", query_starts_ptr="*i32")
constants = {(_combine_splits.arg_names.index(name),): value for name, value in dict(HEAD_DIM=64, BLOCK_D=64,
                                                                                      BLOCK_S=32).items()}
compile_logged(_combine_splits, types, constants, 4)
print("compiled combine", flush=True)
"""


def test_the_kernel_compiles_for_sm90(tmp_path):
    ptxas = Path(pytest.importorskip("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip(f"no ptxas in the triton wheel ({ptxas})")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # Triton 3.9's default, said aloud (it warns otherwise)
    env["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v: registers and spills of every compile
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cached kernel would skip ptxas and its log
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("compiled") == 12, result.stdout
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", result.stdout)]
    assert len(spills) == 12 and not any(spills), result.stdout
