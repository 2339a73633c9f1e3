"""The fused-MoE Triton kernels (rollout/model/moe_triton.py) against the torch path of moe.Experts.

Not collected by itself (no test_ prefix): tests/test_engine_moe_triton.py runs this file in a child pytest, with
TRITON_INTERPRET=1 in the child alone when there is no GPU (see tests/triton_kernel_cases.py for why). With a GPU the
same cases run the compiled kernels on CUDA.
"""

import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
if INTERPRET:
    assert os.environ.get("TRITON_INTERPRET") == "1", (
        "without CUDA these cases need TRITON_INTERPRET=1 from the process's start: run them through "
        "tests/test_engine_moe_triton.py")
    from triton.runtime.interpreter import InterpretedFunction

    from rollout.model import moe_triton

    assert isinstance(moe_triton._gate_up_silu, InterpretedFunction), "the kernel is not the interpreted one"

from rollout.config import EngineConfig, MoeConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.model.moe import Experts, TopKRouter
from rollout.model.moe_triton import BLOCK_M, fused_experts, pad_by_expert
from rollout.model.tiny import write_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def experts_and_routes(tokens: int, hidden: int, inner: int, num_experts: int, top_k: int, dtype: torch.dtype,
                       idle_expert: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    moe = MoeConfig(num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inner,
                    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=())
    experts = Experts(hidden, moe, dtype, torch.device(DEVICE))
    experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=gen) * hidden**-0.5)
    experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=gen) * inner**-0.5)
    router = TopKRouter(hidden, moe, dtype, torch.device(DEVICE))
    router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    weights, chosen = router(x)
    if idle_expert:  # expert 0 gets no token: its tiles are absent, the next expert's start where its would
        chosen = torch.where(chosen == 0, num_experts - 1 - chosen.sum(-1, keepdim=True) % 2, chosen)
        chosen[:, 1] = torch.where(chosen[:, 1] == chosen[:, 0], chosen[:, 0] % (num_experts - 1) + 1, chosen[:, 1])
    return experts, x, weights, chosen


@pytest.mark.parametrize("tokens,hidden,inner", [(1, 64, 32), (5, 64, 48), (37, 40, 24), (70, 128, 96)])
@torch.no_grad()
def test_the_fused_kernels_equal_the_torch_experts_in_float32(tokens, hidden, inner):
    experts, x, weights, chosen = experts_and_routes(tokens, hidden, inner, 8, 2, torch.float32, idle_expert=True)
    assert not (chosen == 0).any() and (chosen[:, 0] != chosen[:, 1]).all()
    expected = experts(x, weights, chosen)
    got = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, chosen)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@torch.no_grad()
def test_the_fused_kernels_stay_within_bfloat16_rounding_of_the_torch_experts():
    experts, x, weights, chosen = experts_and_routes(24, 64, 32, 4, 2, torch.bfloat16, idle_expert=False)
    expected = experts(x, weights, chosen).float()
    got = fused_experts(x, experts.gate_up_proj, experts.down_proj, weights, chosen).float()
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


def test_rows_are_padded_per_expert_to_whole_tiles():
    chosen = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    rows, tile_experts, order = pad_by_expert(chosen, 5, block_m=4)
    # expert 0: rows 1, 4 | expert 2: rows 0, 2, 5 | expert 3: row 3 -- each run padded to 4 slots; P = 6 + 5 * 3 -> 24
    assert rows.tolist() == [1, 4, -1, -1, 0, 2, 5, -1, 3, -1, -1, -1] + [-1] * 12
    assert tile_experts.tolist() == [0, 2, 3, -1, -1, -1]
    assert rows[rows >= 0].tolist() == order.tolist()
    assert BLOCK_M == 16


@torch.no_grad()
def test_an_engine_on_the_kernels_generates_what_the_torch_experts_do(tmp_path):
    model = write_tiny_model(tmp_path / "moe", seed=11, arch="qwen3_moe", num_layers=2)
    prompts = [[1, 5, 6, 7, 8, 9, 10], [1, 70, 71]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        engine = LLMEngine(EngineConfig(model=str(model), device=DEVICE, dtype="float32", block_size=4,
                                        max_model_len=64, moe_backend=backend, attention_backend="torch",
                                        cuda_graphs=False))
        assert engine.config.moe_kernel == backend
        outs[backend] = [out.completions[0] for out in engine.generate(prompts, params)]
    for torch_out, triton_out in zip(outs["torch"], outs["triton"], strict=True):
        assert triton_out.token_ids == torch_out.token_ids
        assert max(abs(a - b) for a, b in zip(triton_out.logprobs, torch_out.logprobs, strict=True)) <= 1e-5
