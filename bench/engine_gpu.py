"""The native engine at a realistic size on a GPU: tokens/s and ms per decode step against transformers' `generate`
and against a launch-free floor, at batch 1, 16, 64 and 256 in the same run.

Model: random weights of Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query / 2 kv heads of 64, MLP 4864, vocab
151,936, untied head; about 630M parameters), bfloat16, lm_head scaled 4x so greedy choices are clear; `--shape
small` is a stand-in of the same code paths for a CPU dry run. Per batch size B: B prompts of `--prompt-len`
tokens, exactly `--new-tokens` greedy tokens each (the engine with ignore_eos, transformers with min_new_tokens),
prefix caching off. One warm-up each, then `--repeats` timed runs alternating; wall clock with a device sync
around each call. A 1-token run of each splits the prefill out: a decode step costs (t_N - t_1) / (N - 1).

The floor: a minimal dense decoder of the same shape and dtype (embedding, per layer RMSNorm, fused QKV with
bias, RoPE, a dense [B, kv heads, prompt + new tokens, 64] cache written in place, SDPA over all of it, output
projection, SwiGLU MLP; final norm, lm_head, argmax fed back as the next input), one decode step captured as one
CUDA graph and replayed N times: what a step costs with no Python, no launches, no paging and no sampling
beyond argmax. On CPU (`--device cpu`, a dry run) it is called eagerly.

The engine runs as configured by default on the device (on CUDA: the Triton kernel and CUDA graphs for decode);
`--attention` and `--no-cuda-graphs` pick other paths for comparison.

    python bench/engine_gpu.py [--quick] [--device cuda|cpu] [--batches 1 16 64 256]
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_shape import DTYPES, EOS, SHAPES, build_model


class Floor:
    """The launch-free floor: one dense decode step of the model's shape on static buffers (see the docstring)."""

    def __init__(self, shape: dict, batch: int, context: int, start: int, dtype: torch.dtype, device: torch.device):
        gen = torch.Generator(device=device).manual_seed(0)
        hidden, heads, kv_heads, head_dim = shape["hidden_size"], shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]

        def weight(*size):
            return (torch.randn(*size, generator=gen, device=device) * 0.02).to(dtype)

        qkv = (heads + 2 * kv_heads) * head_dim
        cache = (batch, kv_heads, context, head_dim)
        self.layers = [{"norm1": torch.ones(hidden, dtype=dtype, device=device), "qkv": weight(qkv, hidden),
                        "qkv_bias": weight(qkv), "o": weight(hidden, heads * head_dim),
                        "norm2": torch.ones(hidden, dtype=dtype, device=device),
                        "gate_up": weight(2 * shape["intermediate_size"], hidden),
                        "down": weight(hidden, shape["intermediate_size"]),
                        "keys": torch.zeros(cache, dtype=dtype, device=device),
                        "values": torch.zeros(cache, dtype=dtype, device=device)}
                       for _ in range(shape["num_layers"])]
        self.embed, self.head = weight(shape["vocab_size"], hidden), weight(shape["vocab_size"], hidden)
        self.norm = torch.ones(hidden, dtype=dtype, device=device)
        self.shape = (heads, kv_heads, head_dim)
        self.ids = torch.ones(batch, dtype=torch.int64, device=device)
        self.position = torch.full((1,), start, dtype=torch.int64, device=device)
        freqs = torch.arange(context, device=device)[:, None] / 1e6 ** (torch.arange(0, head_dim, 2, device=device) / head_dim)
        self.cos, self.sin = (torch.cat([f, f], dim=-1).to(dtype) for f in (freqs.cos(), freqs.sin()))
        self.graph = None

    def step(self) -> None:
        heads, kv_heads, head_dim = self.shape
        x = F.embedding(self.ids, self.embed)
        cos, sin = self.cos[self.position], self.sin[self.position]
        for layer in self.layers:
            h = F.rms_norm(x, x.shape[-1:], layer["norm1"], 1e-6)
            qkv = F.linear(h, layer["qkv"], layer["qkv_bias"]).view(x.shape[0], heads + 2 * kv_heads, head_dim)
            qk = qkv[:, : heads + kv_heads] * cos + qkv[:, : heads + kv_heads].roll(head_dim // 2, -1) * sin
            q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv_heads :]
            layer["keys"].index_copy_(2, self.position, k.unsqueeze(2))
            layer["values"].index_copy_(2, self.position, v.unsqueeze(2))
            attn = F.scaled_dot_product_attention(q.unsqueeze(2), layer["keys"], layer["values"], enable_gqa=True)
            x = x + F.linear(attn.reshape(x.shape[0], -1), layer["o"])
            gate, up = F.linear(F.rms_norm(x, x.shape[-1:], layer["norm2"], 1e-6), layer["gate_up"]).chunk(2, -1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        logits = F.linear(F.rms_norm(x, x.shape[-1:], self.norm, 1e-6), self.head)
        self.ids.copy_(logits.argmax(-1))
        self.position.add_(1)

    @torch.inference_mode()
    def time_steps(self, steps: int) -> float:
        """Seconds per step over `steps` replays (calls on CPU)."""
        start = self.position.clone()
        if self.ids.is_cuda and self.graph is None:
            self.step()  # warm-up outside the capture
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.step()
        run = self.graph.replay if self.graph is not None else self.step
        sync(self.ids.device)
        started = time.perf_counter()
        for _ in range(steps):
            run()
        sync(self.ids.device)
        elapsed = time.perf_counter() - started
        self.position.copy_(start)
        return elapsed / steps


def sync(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    started = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - started


def engine_generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> None:
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    assert sum(len(c.token_ids) for out in outputs for c in out.completions) == len(prompts) * new_tokens


def hf_generate(model, prompts: list[list[int]], new_tokens: int, device: str) -> None:
    ids = torch.tensor(prompts, device=device)  # one length: no padding
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, pad_token_id=0, eos_token_id=EOS)
    assert out.shape[1] - ids.shape[1] == new_tokens


def measure(batch: int, args, engine: LLMEngine, hf_model, vocab: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(1000 + batch)

    def prompts() -> list[list[int]]:
        return [[1, *torch.randint(3, vocab, (args.prompt_len - 1,), generator=gen).tolist()] for _ in range(batch)]

    warm, n = prompts(), args.new_tokens
    engine_generate(engine, warm, 4)
    hf_generate(hf_model, warm, 4, args.device)
    native, hf = [], []
    for _ in range(args.repeats):
        batch_prompts = prompts()
        native.append(timed(lambda p=batch_prompts: engine_generate(engine, p, n), args.device))
        hf.append(timed(lambda p=batch_prompts: hf_generate(hf_model, p, n, args.device), args.device))
    one = prompts()
    native_1 = timed(lambda: engine_generate(engine, one, 1), args.device)
    hf_1 = timed(lambda: hf_generate(hf_model, one, 1, args.device), args.device)
    native_t, hf_t = statistics.median(native), statistics.median(hf)
    floor = Floor(SHAPES[args.shape], batch, args.prompt_len + n, args.prompt_len, DTYPES[args.dtype],
                  torch.device(args.device))
    floor_step = min(floor.time_steps(n) for _ in range(max(1, args.repeats)))
    del floor
    return {"native_tps": batch * n / native_t, "hf_tps": batch * n / hf_t,
            "native_ms": 1e3 * (native_t - native_1) / (n - 1), "hf_ms": 1e3 * (hf_t - hf_1) / (n - 1),
            "floor_ms": 1e3 * floor_step}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: qwen05b on CUDA, small on CPU")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 16 64 256 (quick: 1 16)")
    parser.add_argument("--prompt-len", type=int, default=None, help="default: 128 (quick: 32)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 128 (quick: 16)")
    parser.add_argument("--repeats", type=int, default=None, help="default: 3 (quick: 1)")
    parser.add_argument("--attention", default="auto", choices=["auto", "torch", "triton", "flashinfer"])
    parser.add_argument("--no-cuda-graphs", action="store_true", help="the engine's decode steps eager")
    parser.add_argument("--quick", action="store_true", help="small batches and lengths: a smoke test under a minute")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on CPU")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("qwen05b" if cuda else "small")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.batches = args.batches or ([1, 16] if args.quick else [1, 16, 64, 256])
    args.prompt_len = args.prompt_len or (32 if args.quick else 128)
    args.new_tokens = args.new_tokens or (16 if args.quick else 128)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if not cuda:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    vocab = SHAPES[args.shape]["vocab_size"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp) / "model", args.shape, args.dtype, args.device,
                             args.prompt_len + args.new_tokens + 16, head_scale=4.0)
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[args.dtype]).to(args.device).eval()
        config = EngineConfig(model=str(folder), dtype=args.dtype, device=args.device,
                              max_model_len=args.prompt_len + args.new_tokens + 16, max_num_seqs=max(args.batches),
                              max_num_batched_tokens=max(4096, max(args.batches)), max_n=1,
                              enable_prefix_caching=False, kv_cache_memory_bytes=8 << 30,
                              attention_backend=args.attention, cuda_graphs=False if args.no_cuda_graphs else None)
        engine = LLMEngine(config)
        device_name = torch.cuda.get_device_name(0) if cuda else "cpu"
        print(f"{args.shape} {args.dtype} on {device_name} (torch {torch.__version__}); engine: attention "
              f"{config.attention_kernel}, cuda_graphs {config.cuda_graphs}, {config.num_blocks} blocks of "
              f"{config.block_size}; prompts of {args.prompt_len} tokens, {args.new_tokens} greedy tokens each, median "
              f"of {args.repeats}; started in {time.perf_counter() - started:.1f}s", flush=True)
        graphs = engine.runner.graphs
        if graphs is not None and graphs.capture_stats:  # captured at start, largest bucket first, one memory pool
            stats = graphs.capture_stats
            print("CUDA graph captures: " + ", ".join(f"bs{bucket} {1e3 * seconds:.0f} ms {grown / 2**20:.0f} MiB"
                                                      for bucket, (seconds, grown) in sorted(stats.items())))
            print(f"result: cuda_graph_capture_s = {sum(s for s, _ in stats.values()):.2f} (baseline none: {len(stats)} "
                  f"buckets up to {max(stats)}, the pool grew {sum(g for _, g in stats.values()) / 2**20:.0f} MiB; "
                  f"captured once per engine, kept across weight updates)", flush=True)
        print(f"{'B':>4} | {'native tok/s':>12} | {'hf tok/s':>9} | {'x hf':>5} | {'native ms/step':>14} | "
              f"{'hf ms/step':>10} | {'floor ms/step':>13} | {'x floor':>7}", flush=True)
        rows = {}
        for batch in args.batches:
            r = rows[batch] = measure(batch, args, engine, hf_model, vocab)
            print(f"{batch:>4} | {r['native_tps']:>12.0f} | {r['hf_tps']:>9.0f} | {r['native_tps'] / r['hf_tps']:>5.2f} | "
                  f"{r['native_ms']:>14.2f} | {r['hf_ms']:>10.2f} | {r['floor_ms']:>13.3f} | "
                  f"{r['native_ms'] / r['floor_ms']:>7.2f}", flush=True)
    where = f"{args.shape} {args.dtype} on {device_name}"
    targets = {1: ">= 300 tok/s", 64: ">= 16,000 tok/s"} if args.shape == "qwen05b" and cuda else {}
    for batch, r in rows.items():
        target = targets.get(batch, "none set")
        print(f"result: native_tokens_per_s_bs{batch} = {r['native_tps']:.0f} (baseline transformers generate "
              f"{r['hf_tps']:.0f} tok/s, {r['native_tps'] / r['hf_tps']:.2f}x; {where}; target {target})")
        print(f"result: native_step_vs_floor_bs{batch} = {r['native_ms'] / r['floor_ms']:.2f} (baseline launch-free "
              f"floor {r['floor_ms']:.3f} ms/step, native {r['native_ms']:.2f} ms/step; {where}; target "
              f"{'<= 1.5' if batch == 64 and cuda else 'none set'})")
    if cuda:
        print(f"peak GPU memory allocated: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    print(f"done in {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
