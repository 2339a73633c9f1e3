"""FlashInfer's paged kernel behind the engine's attention call (rollout/model/attention_flashinfer.py).

The `gpu` tests need CUDA and flashinfer: the kernel against attention computed in float32 from the same cache
through the same block tables (decodes, whole prefills and prefill chunks of mixed lengths, grouped-query heads,
blocks out of order), and an engine on the kernel against an engine on the torch path (greedy tokens, and the
logprobs of those tokens). The others run anywhere: which backend an engine gets, and the refusals.
"""

import pytest
import torch

from rollout.config import EngineConfig, choose_attention
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.kv.cache import KVCache
from rollout.model.attention_flashinfer import FlashInferAttention


def _needs_flashinfer() -> None:
    pytest.importorskip("flashinfer")


def _reference(q, keys, values, table, query_len, kv_len, block_size) -> torch.Tensor:
    """One sequence's causal attention in float32: its queries are the last `query_len` of its `kv_len` slots."""
    slots = torch.tensor([table[s // block_size] * block_size + s % block_size for s in range(kv_len)], device=q.device)
    k = keys.reshape(-1, *keys.shape[2:])[slots].float().transpose(0, 1)  # [Hkv, kv, D]
    v = values.reshape(-1, *values.shape[2:])[slots].float().transpose(0, 1)
    queries = q.float().transpose(0, 1)  # [Hq, query_len, D]
    visible = torch.arange(kv_len, device=q.device) <= (kv_len - query_len + torch.arange(query_len, device=q.device))[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        queries, k, v, attn_mask=visible, scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out.transpose(0, 1).reshape(query_len, -1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_kernel_equals_float32_attention_over_the_same_blocks(dtype):
    """Decodes (1 query), whole prefills and prefill chunks (queries < context), 1 to 40 blocks of 16, 8 query heads
    over 2 kv heads, head_dim 128, block tables shuffled through the pool."""
    _needs_flashinfer()
    device = torch.device("cuda", 0)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 256, 8, 2, 128
    gen = torch.Generator(device=device).manual_seed(0)
    keys = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    values = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen, device=device).to(dtype)
    shapes = [(1, 1), (1, 17), (1, 640), (5, 5), (33, 33), (12, 200), (1, 16), (64, 64 + 31), (1, 33)]  # (query, kv)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables, used = [], 0
    for _, kv_len in shapes:
        n = -(-kv_len // block_size)
        tables.append(order[used : used + n])
        used += n
    assert used <= num_blocks
    q = torch.randn(sum(n for n, _ in shapes), heads, head_dim, generator=gen, device=device).to(dtype)
    kernel = FlashInferAttention(heads, kv_heads, head_dim, block_size, dtype, device)
    kernel.plan(tables, [n for n, _ in shapes], [kv for _, kv in shapes])
    cache = KVCache(1, num_blocks, block_size, kv_heads, head_dim, dtype, device)
    cache.keys[0], cache.values[0] = keys, values
    out = kernel.attend(q, 0, cache)
    assert out.shape == (q.shape[0], heads * head_dim) and out.dtype == dtype
    row = 0
    tolerance = 1e-2 if dtype == torch.float16 else 3e-2
    for table, (query_len, kv_len) in zip(tables, shapes):
        expected = _reference(q[row : row + query_len], keys, values, table, query_len, kv_len, block_size)
        torch.testing.assert_close(out[row : row + query_len].float(), expected, atol=tolerance, rtol=0)
        row += query_len


@pytest.fixture(scope="module")
def wide_sharp_model_dir(tmp_path_factory):
    """A tiny Qwen2 with head_dim 64 (a size FlashInfer has kernels for) and its logits scaled 4x, so that greedy
    choices are rarely near-ties (see tests/conftest.py: sharp_model_dir)."""
    from safetensors.torch import load_file, save_file

    from rollout.model.tiny import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("wide-sharp") / "qwen2", hidden_size=256, num_heads=4,
                            num_kv_heads=2, head_dim=64, seed=5)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.gpu
def test_an_engine_on_the_kernel_decodes_as_the_torch_path(wide_sharp_model_dir):
    """float16 on CUDA; a 64-token step budget, so long prompts are prefilled in chunks while others decode. The
    kernel engine's greedy tokens equal the torch engine's, except from a position where the torch engine itself
    sees a near-tie (top-2 within 0.05); the logprobs it reports for its tokens equal the torch engine's scoring of
    the same tokens within float16 tolerance."""
    _needs_flashinfer()
    config = {"model": str(wide_sharp_model_dir), "device": "cuda", "dtype": "float16", "block_size": 16,
              "max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    kernel_engine = LLMEngine(EngineConfig(**config, attention_backend="flashinfer"))
    torch_engine = LLMEngine(EngineConfig(**config, attention_backend="torch"))
    assert kernel_engine.runner.kernel is not None and torch_engine.runner.kernel is None
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (3, 70, 9, 130, 17, 5, 52)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    got = [out.completions[0] for out in kernel_engine.generate(prompts, params)]
    expected = [out.completions[0] for out in torch_engine.generate(prompts, params)]
    for prompt, mine, theirs in zip(prompts, got, expected):
        if mine.token_ids != theirs.token_ids:
            first = next(i for i, (a, b) in enumerate(zip(mine.token_ids, theirs.token_ids)) if a != b)
            top = torch_engine.compute_top_logprobs(prompt, theirs.token_ids[: first + 1], 1.0, 2)[first]
            assert top[0][1] - top[1][1] < 0.05, (first, top)
        scored = torch_engine.compute_logprobs(prompt, [mine.token_ids])[0]
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(scored), atol=2e-2, rtol=0)
    assert kernel_engine.block_manager.num_free_blocks == kernel_engine.block_manager.num_blocks


def test_flashinfer_runs_only_when_named_and_a_named_kernel_says_why_not(tiny_model_dir, monkeypatch):
    """'auto' never takes FlashInfer (the Triton kernel is the default on CUDA, tests/test_engine_attention_triton.py)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert choose_attention("torch", cuda, torch.bfloat16, 128, "auto") == "torch"
    for device, dtype, head_dim, kv in ((cpu, torch.bfloat16, 128, "auto"), (cuda, torch.float32, 128, "auto"),
                                        (cuda, torch.bfloat16, 32, "auto"), (cuda, torch.bfloat16, 128, "int8")):
        assert choose_attention("auto", device, dtype, head_dim, kv) in ("torch", "triton")
    with pytest.raises(ValueError, match="runs on CUDA devices.*float16 and bfloat16.*head_dim 64, 128, 256"):
        choose_attention("flashinfer", cpu, torch.float32, 32, "auto")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        choose_attention("flashinfer", cuda, torch.bfloat16, 128, "int8")
    with pytest.raises(ValueError, match="attention_backend 'flashinfer': it runs on CUDA devices, the engine is on cpu"):
        EngineConfig(model=str(tiny_model_dir), attention_backend="flashinfer")
    with pytest.raises(ValueError, match="attention_backend: 'xformers'"):
        EngineConfig(model=str(tiny_model_dir), attention_backend="xformers")
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=16, max_model_len=64))
    assert engine.config.attention_kernel == "torch" and engine.runner.kernel is None
