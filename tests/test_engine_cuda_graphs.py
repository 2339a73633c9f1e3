"""Decode steps on static buffers per batch-size bucket (rollout/engine/cuda_graphs.py).

On CPU a bucket's "replay" is a plain call of the model on the same static buffers, so everything but the capture is
tested here: the buckets, the padding of a batch to its bucket (padding rows write only the scratch block), the
buffers reused across steps, and outputs equal to the eager path's. The `gpu` tests capture real CUDA graphs.
"""

import pytest
import torch

from rollout.config import EngineConfig, choose_cuda_graphs
from rollout.engine.cuda_graphs import batch_buckets
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 100, (n,), generator=gen).tolist() for n in lengths]


def _generate(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    return [(c.token_ids, c.logprobs) for out in engine.generate(prompts, params) for c in out.completions]


def _assert_same(got, expected, atol: float) -> None:
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in expected]
    for (_, mine), (_, theirs) in zip(got, expected):
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(theirs), atol=atol, rtol=0)


def test_buckets_are_powers_of_two_then_multiples_of_16_up_to_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(256)[-3:] == [224, 240, 256]


def test_static_buffer_decode_equals_the_eager_path(tiny_model_dir):
    """Seven prompts of 3-60 tokens, greedy ones with different max_tokens (so the batch shrinks through buckets 8, 4,
    2, 1) and a sampled request with n=2, a 24-token budget (long prompts prefill in chunks while others decode, those
    steps eager): the same tokens as the eager engine, logprobs within 1e-5, every pure decode step from the buffers."""
    config = {"model": str(tiny_model_dir), "block_size": 4, "max_model_len": 128, "max_num_seqs": 8, "max_n": 2,
              "max_num_batched_tokens": 24}
    static = LLMEngine(EngineConfig(**config, cuda_graphs=True))
    eager = LLMEngine(EngineConfig(**config))
    graphs = static.runner.graphs
    assert graphs is not None and eager.runner.graphs is None and eager.config.cuda_graphs is False
    assert static.runner.cache.keys.shape[1] == static.config.num_blocks + 1  # the scratch block
    assert static.block_manager.num_blocks == static.config.num_blocks
    steps = []
    run = graphs.run
    graphs.run = lambda rows: (steps.append((len(rows), graphs.bucket_for(len(rows)), graphs.inputs.data_ptr())),
                               run(rows))[1]
    prompts = _prompts([3, 60, 9, 33, 17, 5, 41], seed=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 30, 9, 14, 5, 20, 3)]
    params[3] = SamplingParams(temperature=1.0, max_tokens=14, n=2, seed=11, ignore_eos=True)
    _assert_same(_generate(static, prompts, params), _generate(eager, prompts, params), atol=1e-5)
    assert graphs.num_replays == len(steps) > 20
    assert {bucket for _, bucket, _ in steps} == {1, 2, 4, 8}
    assert any(size < bucket for size, bucket, _ in steps)  # batches padded to their bucket
    assert {pointer for _, _, pointer in steps} == {graphs.inputs.data_ptr()}  # one set of buffers, every step
    assert static.block_manager.num_free_blocks == static.block_manager.num_blocks


def test_padding_rows_write_only_the_scratch_block_and_are_left_out(tiny_model_dir):
    """Three sequences decode as bucket 4: the fourth row is padding (token 0, position 0, the scratch block's first
    slot, context 1), the step returns three rows, and no block but the scratch one sees the padding's keys."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), block_size=4, max_model_len=64, max_num_seqs=4, max_n=2,
                                    num_blocks=24, cuda_graphs=True))
    graphs, cache = engine.runner.graphs, engine.runner.cache
    scratch = engine.config.num_blocks
    shapes = []
    run = graphs.run
    graphs.run = lambda rows: (result := run(rows), shapes.append((len(rows), tuple(result.shape))))[0]
    cache.keys.fill_(7.0)  # a mark on every slot: the slots written are those that lose it
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for i, prompt in enumerate(_prompts([5, 6, 7], seed=2)):
        engine.add_request(f"r{i}", prompt, params)
    used = set()  # the blocks of every sequence of every step
    run_batch = engine.runner.run
    engine.runner.run = lambda batch: (used.update(b for seq in batch.seqs for b in seq.block_table), run_batch(batch))[1]
    while engine.has_unfinished_requests():
        engine.step()
    hidden = engine.model_config.hidden_size
    assert shapes == [(3, (3, hidden))] * 2 and graphs.last_bucket == 4
    assert graphs.inputs[3, :5].tolist() == [0, 0, scratch * 4, 1, scratch]
    written = (cache.keys != 7.0).any(dim=4).any(dim=3).any(dim=0)  # [blocks, slots]
    assert written[scratch].tolist() == [True, False, False, False]
    assert set(written.any(dim=1).nonzero().flatten().tolist()) == used | {scratch}


def test_cuda_graphs_default_on_cuda_with_the_kernel_and_refuse_what_they_cannot_replay(tiny_model_dir):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert choose_cuda_graphs(None, cuda, "triton", "auto") is True
    assert choose_cuda_graphs(None, cuda, "torch", "auto") is False  # the torch path's shapes change every step
    assert choose_cuda_graphs(None, cuda, "triton", "int8") is False
    assert choose_cuda_graphs(None, cpu, "torch", "auto") is False
    assert choose_cuda_graphs(True, cpu, "torch", "auto") is True  # static buffers, plain calls
    assert choose_cuda_graphs(False, cuda, "triton", "auto") is False
    with pytest.raises(ValueError, match="cuda_graphs: a replayed decode needs attention over fixed shapes.*'flashinfer'"):
        choose_cuda_graphs(True, cuda, "flashinfer", "auto")
    with pytest.raises(ValueError, match="cuda_graphs: kv_cache_dtype 'int4': the quantized cache plans its writes"):
        EngineConfig(model=str(tiny_model_dir), kv_cache_dtype="int4", cuda_graphs=True)
    assert EngineConfig(model=str(tiny_model_dir)).cuda_graphs is False


@pytest.fixture(scope="module")
def sharp_wide_model_dir(tmp_path_factory):
    """A tiny Qwen2 with head_dim 64 and its logits scaled 4x (greedy choices rarely near-ties)."""
    from safetensors.torch import load_file, save_file

    from rollout.model.tiny import write_tiny_model

    path = write_tiny_model(tmp_path_factory.mktemp("graphs") / "qwen2", hidden_size=256, num_heads=4, num_kv_heads=2,
                            head_dim=64, seed=7)
    weights = load_file(path / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 4.0
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _changed_weights(folder, out_dir, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The model's weights, each moved by 5% of its own spread (seeded), saved as a model folder at out_dir too."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out_dir)
    gen = torch.Generator().manual_seed(17)
    weights = {name: tensor + 0.05 * tensor.float().std() * torch.randn(tensor.shape, generator=gen).to(tensor.dtype)
               for name, tensor in load_file(folder / "model.safetensors").items()}
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return {name: tensor.to(device) for name, tensor in weights.items()}


def test_an_adopted_update_is_copied_into_the_served_parameters_and_keeps_the_graphs(sharp_model_dir, tmp_path):
    """With static buffers (cuda_graphs) an update handed over for adoption is copied into the parameters the graphs
    were captured with: their storage stays (the old engine rebound it and reset the graphs), the graphs are kept, the
    given tensors are not served (zeroing them afterwards changes nothing), and the engine then decodes as a fresh
    engine loaded with the changed weights."""
    config = {"block_size": 4, "max_model_len": 96, "max_num_seqs": 4, "max_n": 2, "max_num_batched_tokens": 32}
    engine = LLMEngine(EngineConfig(model=str(sharp_model_dir), **config, cuda_graphs=True))
    graphs = engine.runner.graphs
    prompts = _prompts([5, 17, 9], seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 3
    before = _generate(engine, prompts, params)
    storage = {name: p.data_ptr() for name, p in engine.runner.model.named_parameters()}
    graphs.graphs[1] = captured = object()  # stands for a captured graph (CPU captures none)
    weights = _changed_weights(sharp_model_dir, tmp_path / "changed")
    engine.load_weights(weights, version=1, adopt=True)
    assert graphs.graphs == {1: captured}
    del graphs.graphs[1]
    assert {name: p.data_ptr() for name, p in engine.runner.model.named_parameters()} == storage
    for tensor in weights.values():
        tensor.zero_()
    fresh = LLMEngine(EngineConfig(model=str(tmp_path / "changed"), **config, cuda_graphs=True))
    after = _generate(engine, prompts, params)
    _assert_same(after, _generate(fresh, prompts, params), atol=1e-6)
    assert after != before and graphs.num_replays > 0


@pytest.mark.gpu
def test_replayed_decode_equals_the_eager_kernel_and_survives_a_changed_update(sharp_wide_model_dir, tmp_path):
    """float32 on CUDA: an engine replaying CUDA graphs (captured for every bucket at start) decodes the tokens of
    one running the same Triton kernel eagerly, logprobs within 1e-4 (a bucket's matmuls may take other cuBLAS
    kernels than the unpadded batch's), and of the torch path. After an update of CHANGED weights handed over for
    adoption, the same graphs (none captured again) decode as a fresh engine loaded with those weights."""
    config = {"model": str(sharp_wide_model_dir), "device": "cuda", "dtype": "float32", "block_size": 16,
              "max_model_len": 256, "max_num_seqs": 16, "max_num_batched_tokens": 64, "attention_backend": "triton"}
    replayed = LLMEngine(EngineConfig(**config))
    eager = LLMEngine(EngineConfig(**config, cuda_graphs=False))
    reference = LLMEngine(EngineConfig(**{**config, "attention_backend": "torch"}))
    graphs = replayed.runner.graphs
    assert replayed.config.cuda_graphs and graphs.capture and sorted(graphs.graphs) == graphs.buckets
    prompts = _prompts([3, 70, 9, 130, 17, 5, 52, 11, 200, 6], seed=5)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 8, 30, 12, 5, 40, 16, 3, 20, 9)]
    got = _generate(replayed, prompts, params)
    _assert_same(got, _generate(eager, prompts, params), atol=1e-4)
    _assert_same(got, _generate(reference, prompts, params), atol=1e-4)
    assert graphs.num_replays > 30
    captured = dict(graphs.graphs)
    replayed.load_weights(_changed_weights(sharp_wide_model_dir, tmp_path / "changed", "cuda"), version=1, adopt=True)
    fresh = LLMEngine(EngineConfig(**{**config, "model": str(tmp_path / "changed")}))
    changed = _generate(replayed, prompts, params)
    assert graphs.graphs == captured  # the same graph objects: nothing captured again
    _assert_same(changed, _generate(fresh, prompts, params), atol=1e-4)
    assert [tokens for tokens, _ in changed] != [tokens for tokens, _ in got]  # the update changed what is decoded


@pytest.mark.gpu
def test_bfloat16_by_default_on_cuda_the_kernel_and_graphs_follow_the_torch_path(sharp_wide_model_dir):
    """The engine's defaults on CUDA since issue 34: bfloat16, the Triton kernel's bfloat16 dots, CUDA graphs with
    split-K decode at small batches. Against the torch path in bfloat16: every prompt's first greedy token equal, and
    over the tokens both produced alike logprobs within 0.05 (the same bf16 model, roundings in another order)."""
    config = {"model": str(sharp_wide_model_dir), "device": "cuda", "block_size": 16, "max_model_len": 256,
              "max_num_seqs": 16, "max_num_batched_tokens": 64}
    kernel = LLMEngine(EngineConfig(**config))
    assert (kernel.config.torch_dtype, kernel.config.attention_kernel, kernel.config.cuda_graphs) == (
        torch.bfloat16, "triton", True)
    reference = LLMEngine(EngineConfig(**config, attention_backend="torch"))
    prompts = _prompts([3, 70, 9, 130, 17, 5], seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(prompts)
    for (tokens, logprobs), (expected, expected_logprobs) in zip(_generate(kernel, prompts, params),
                                                                 _generate(reference, prompts, params)):
        assert tokens[0] == expected[0]
        alike = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(tokens))
        assert max(abs(a - b) for a, b in zip(logprobs[:alike], expected_logprobs[:alike])) < 0.05
    assert kernel.runner.graphs.num_replays > 10
