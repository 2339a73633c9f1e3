"""The Triton paged-attention kernel (rollout/model/attention_triton.py) against the torch path over the same cache.

Not collected by itself (no test_ prefix): tests/test_engine_attention_triton.py runs this file in a child pytest.
Without a GPU the kernel runs in Triton's interpreter, which must be on before triton is first imported (torch._dynamo,
which FSDP and DCP import, imports triton in any full run), and whose switch, TRITON_INTERPRET=1, every process started
by a test with it would inherit: torchrun ranks importing triton in interpreter mode aborted at exit ("terminate called
without an active exception", 2 of 10 runs of tests/test_trainer_parallel.py's job). So the child alone has it, from its
start. With a GPU the same cases run the compiled kernel on CUDA. Each case builds one cache (float, int8 or int4; the
quantized one holds closed blocks and open float blocks, as the engine leaves it) with sequences of mixed lengths:
decodes, prefill chunks after a cached context, a whole prefill, blocks scattered through the pool; and compares
every layer's attention of both paths, then an engine on the kernel with one on torch.
"""

import os

import pytest
import torch

INTERPRET = not torch.cuda.is_available()
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")
if INTERPRET:
    assert os.environ.get("TRITON_INTERPRET") == "1", (
        "without CUDA these cases need TRITON_INTERPRET=1 from the process's start: run them through "
        "tests/test_engine_attention_triton.py")
    from triton.runtime.interpreter import InterpretedFunction

    from rollout.model import attention_triton

    assert isinstance(attention_triton._paged_attention, InterpretedFunction), "the kernel is not the interpreted one"

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.model_runner import ModelRunner
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.sequence import Sequence
from rollout.model.attention import attend
from rollout.model.tiny import write_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (context length, new tokens): decodes first (the torch path groups one-token rows apart), then prefill chunks
# after a cached context, a whole prefill, and a chunk crossing several blocks.
SHAPES = [(1, 1), (9, 1), (40, 1), (12, 5), (33, 33), (70, 3)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Head layouts: grouped-query (6 query heads over 2 kv heads, head_dim 32) and plain multi-head (4 over 4, head_dim 48: padded to 64 in the kernel, one value group per head)."""
    root = tmp_path_factory.mktemp("triton-models")
    return {"gqa": str(write_tiny_model(root / "gqa", hidden_size=192, num_heads=6, num_kv_heads=2, head_dim=32)),
            "mha": str(write_tiny_model(root / "mha", hidden_size=192, num_heads=4, num_kv_heads=4, head_dim=48))}


def _filled_runner(model: str, dtype: str, kv_cache_dtype: str, shapes: list[tuple[int, int]], seed: int = 0):
    """A runner whose cache holds each sequence's context before its new tokens, then its new tokens: written as
    two engine steps would write them, so a quantized cache has closed blocks and open ones."""
    config = EngineConfig(model=model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, device=DEVICE, block_size=4,
                          num_blocks=96, max_model_len=128, attention_backend="torch")
    runner = ModelRunner(config)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(config.num_blocks, generator=gen).tolist()
    seqs, used = [], 0
    for i, (context, new) in enumerate(shapes):
        seq = Sequence(i, "r", 0, torch.randint(3, 90, (context,), generator=gen).tolist(), SamplingParams(), 0)
        blocks = -(-context // config.block_size)
        seq.block_table, used = order[used : used + blocks], used + blocks
        seq.num_cached_tokens = context - new
        seqs.append(seq)
    cache, m = runner.cache, config.model_config
    for cached in (True, False):  # two writes, as two steps: the cached context, then the new tokens
        slots = [seq.block_table[p // 4] * 4 + p % 4 for seq in seqs
                 for p in (range(seq.num_cached_tokens) if cached else range(seq.num_cached_tokens, len(seq)))]
        if not slots:
            continue
        slot_mapping = torch.tensor(slots, device=DEVICE)
        for layer in range(m.num_layers):
            k, v = (torch.randn(len(slots), m.num_kv_heads, m.head_dim, generator=gen).to(DEVICE, config.torch_dtype)
                    for _ in range(2))
            cache.write(layer, slot_mapping, k, v)
    return runner, seqs


def _compare(runner: ModelRunner, seqs: list[Sequence], is_prefill: bool, tolerance: float, seed: int = 1,
             splits: int | None = None) -> None:
    m = runner.model.config
    query_lens = [len(seq) - seq.num_cached_tokens for seq in seqs] if is_prefill else None
    _, _, torch_meta, _ = runner._prepare(seqs, is_prefill, query_lens)
    runner.attention_kernel = "triton"
    _, _, triton_meta, _ = runner._prepare(seqs, is_prefill, query_lens)
    runner.attention_kernel = "torch"
    assert torch_meta.kernel is None and triton_meta.kernel is not None and not triton_meta.groups
    triton_meta.kernel.num_splits = splits
    rows = sum(query_lens) if is_prefill else len(seqs)
    gen = torch.Generator().manual_seed(seed)
    dtype = next(runner.model.parameters()).dtype
    q = torch.randn(rows, m.num_heads, m.head_dim, generator=gen).to(runner.device, dtype)
    for layer in range(m.num_layers):
        expected = attend(q, layer, runner.cache, torch_meta, runner.scale)
        got = attend(q, layer, runner.cache, triton_meta, runner.scale)
        assert got.shape == expected.shape and got.dtype == expected.dtype
        # bfloat16: also relative, as both outputs are rounded to it (one step at |x| in [2, 4) is 0.0156)
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=0 if tolerance < 1e-2 else 1e-2)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_kernel_equals_the_torch_path_over_decodes_and_prefill_chunks(models, dtype, kv_cache_dtype):
    """Grouped-query heads, blocks of 4 scattered through the pool, contexts of 1-70 slots; a mixed step (decodes and
    chunks) and a pure decode step (one query tile: the kernel's decode variant). Within 1e-5 in float32, 1e-2 in
    bfloat16 (absolute and relative), on the quantized caches too (the kernel dequantizes closed blocks itself and reads open ones)."""
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    runner, seqs = _filled_runner(models["gqa"], dtype, kv_cache_dtype, SHAPES)
    if kv_cache_dtype != "auto":
        assert runner.cache.num_open > 0 and (runner.cache.open_slot < 0).sum() > 0  # both kinds of block are read
    _compare(runner, seqs, is_prefill=True, tolerance=tolerance)
    decodes, _ = _filled_runner(models["gqa"], dtype, kv_cache_dtype, [(n, 1) for n in (1, 4, 5, 17, 64, 100)], seed=2)
    _compare(decodes, _, is_prefill=False, tolerance=tolerance)


def test_the_kernel_equals_the_torch_path_with_as_many_kv_heads_as_query_heads(models):
    """Multi-head attention (a group of 1) with head_dim 48, float32 and int4."""
    for kv_cache_dtype in ("auto", "int4"):
        runner, seqs = _filled_runner(models["mha"], "float32", kv_cache_dtype, SHAPES, seed=3)
        _compare(runner, seqs, is_prefill=True, tolerance=1e-5)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_an_engine_on_the_kernel_decodes_as_the_torch_path(sharp_model_dir, cuda_graphs):
    """The tiny model (4 query / 2 kv heads) in float32 with a 24-token step budget, so long prompts prefill in chunks
    while others decode: greedy tokens equal the torch engine's and their logprobs agree within 1e-5. With
    cuda_graphs the decode steps run the kernel from the static buffers of their batch-size bucket."""
    config = {"model": str(sharp_model_dir), "device": DEVICE, "dtype": "float32", "block_size": 4, "max_model_len": 96,
              "max_num_seqs": 8, "max_n": 2, "max_num_batched_tokens": 24}
    kernel_engine = LLMEngine(EngineConfig(**config, attention_backend="triton", cuda_graphs=cuda_graphs))
    torch_engine = LLMEngine(EngineConfig(**config, attention_backend="torch", cuda_graphs=False))
    assert kernel_engine.config.attention_kernel == "triton" and torch_engine.config.attention_kernel == "torch"
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (3, 50, 9, 30, 5)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (12, 8, 16, 10, 14)]
    got = [out.completions[0] for out in kernel_engine.generate(prompts, params)]
    expected = [out.completions[0] for out in torch_engine.generate(prompts, params)]
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    for mine, theirs in zip(got, expected):
        torch.testing.assert_close(torch.tensor(mine.logprobs), torch.tensor(theirs.logprobs), atol=1e-5, rtol=0)
    graphs = kernel_engine.runner.graphs
    assert (graphs is not None and graphs.num_replays > 0) == cuda_graphs
    assert kernel_engine.block_manager.num_free_blocks == kernel_engine.block_manager.num_blocks


def test_auto_takes_the_kernel_on_cuda_and_torch_elsewhere(monkeypatch):
    """Pure choice, no GPU needed: 'auto' is triton on CUDA (any dtype, head size, quantized cache), torch on CPU even
    under the interpreter; 'triton' by name on CPU needs the interpreter, else it says why."""
    from rollout.config import choose_attention

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    for dtype, head_dim, kv in ((torch.bfloat16, 128, "auto"), (torch.float32, 48, "int4"), (torch.float16, 64, "int8")):
        assert choose_attention("auto", cuda, dtype, head_dim, kv) == "triton"
    assert choose_attention("auto", cpu, torch.float32, 32, "auto") == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the choice only (on CUDA this child lacks it)
    assert choose_attention("triton", cpu, torch.float32, 32, "auto") == "triton"
    assert choose_attention("auto", cpu, torch.float32, 32, "auto") == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend 'triton': it runs on CUDA devices \(on CPU in Triton's "
                                         r"interpreter: TRITON_INTERPRET=1\), the engine is on cpu"):
        choose_attention("triton", cpu, torch.float32, 32, "auto")
    assert choose_attention("auto", cpu, torch.float32, 32, "auto") == "torch"


class _Programs:
    """In the interpreter: the grids launched, and the loads each program (seq, kv head, third axis) made."""

    def __init__(self, monkeypatch):
        from triton.runtime.interpreter import InterpreterBuilder

        self.grids, self.loads = [], {}
        load, grid = InterpreterBuilder.create_masked_load, InterpreterBuilder.set_grid_dim

        def counted(builder, *args):
            self.loads[builder.grid_idx] = self.loads.get(builder.grid_idx, 0) + 1
            return load(builder, *args)

        def recorded(builder, *dims):
            self.grids.append(dims)
            return grid(builder, *dims)

        monkeypatch.setattr(InterpreterBuilder, "create_masked_load", counted)
        monkeypatch.setattr(InterpreterBuilder, "set_grid_dim", recorded)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_prefill_tiles_past_a_sequences_chunk_read_nothing(models, monkeypatch, kv_cache_dtype):
    """A mixed step's grid has the longest chunk's query tiles for every sequence: a decode row's, or a short chunk's,
    tiles past its own new tokens load their sequence's bounds and (masked) queries, and no key, value or block
    table (the old kernel read the whole context there and stored nothing). The output still equals the torch
    path's. (Loads are counted in the interpreter; on CUDA the comparison alone runs.)"""
    from rollout.model import attention_triton

    runner, seqs = _filled_runner(models["gqa"], "float32", kv_cache_dtype, SHAPES)
    programs = _Programs(monkeypatch) if INTERPRET else None
    _compare(runner, seqs, is_prefill=True, tolerance=1e-5)
    if not INTERPRET:
        return
    shape = getattr(attention_triton, "launch_shape", None)  # (the old kernel: 16 queries per program)
    block_q = shape(False, 3, 32, 0, True).block_q if shape else attention_triton.PREFILL_BLOCK_Q  # a group of 3
    new = [n for _, n in SHAPES]
    assert programs.grids[0] == (len(SHAPES), 2, -(-max(new) // block_q))
    loads = programs.loads  # (seq, kv head, query tile) -> loads over every layer's launch
    empty = {idx: count for idx, count in loads.items() if idx[2] * block_q >= new[idx[0]]}
    full = {idx: count for idx, count in loads.items() if idx[2] * block_q < new[idx[0]]}
    assert len(empty) == 2 * sum(-(-max(new) // block_q) - -(-n // block_q) for n in new) > 0
    per_layer = runner.model.config.num_layers
    assert max(empty.values()) <= 4 * per_layer  # query start and end, context length, the (masked) queries
    assert min(full.values()) > 4 * per_layer


@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "auto"), ("float32", "int4"), ("bfloat16", "int8")])
def test_a_split_decode_equals_the_torch_path(models, monkeypatch, dtype, kv_cache_dtype):
    """Decodes over contexts of 1-100 slots, each split into 4 partitions (split-K: one program each, merged by
    _combine_splits; a context shorter than a partition leaves whole partitions empty) and not split at all: the
    torch path's output both ways, within 1e-5 in float32 (1e-2 in bfloat16). The grid has a program per partition."""
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    runner, seqs = _filled_runner(models["gqa"], dtype, kv_cache_dtype, [(n, 1) for n in (1, 4, 5, 17, 64, 100)], seed=4)
    for splits in (4, 1):
        programs = _Programs(monkeypatch) if INTERPRET else None
        _compare(runner, seqs, is_prefill=False, tolerance=tolerance, splits=splits)
        if INTERPRET:
            layers = runner.model.config.num_layers
            expected = [(6, 2, 4), (6, 6, 1)] * layers if splits == 4 else [(6, 2, 1)] * layers
            assert programs.grids == expected


def test_decode_splits_fill_the_gpu_with_partitions_of_64_slots_at_least():
    """The split rule, from shapes alone (a CUDA graph bucket's is fixed): about 256 programs, at most 32 partitions,
    none under 64 slots; none when the batch's sequences and kv heads already make 256 programs."""
    from rollout.model.attention_triton import decode_splits

    assert decode_splits(1, 2, 32768) == 32
    assert decode_splits(1, 2, 256) == 4
    assert decode_splits(16, 2, 4096) == 8
    assert decode_splits(64, 2, 4096) == 2
    assert decode_splits(128, 2, 4096) == decode_splits(256, 2, 32768) == 1
    assert decode_splits(4, 2, 40) == 1
