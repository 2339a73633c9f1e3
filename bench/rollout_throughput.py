"""Generated tokens/s: the native engine vs transformers `generate` (and vLLM where it is importable), same
tiny model, same prompts.

Model: a tiny Qwen2 (hidden 256, 4 layers, 4 heads / 2 kv heads, head_dim 64, char vocabulary),
float32, CPU. Workload per batch size B: B prompts of 16-48 tokens, sampled at temperature 1
(no top-k/top-p), up to `--max-tokens` new tokens each, stopping at eos as a real rollout does.
transformers gets the prompts left-padded in one `generate` call; the engine gets B requests at
once (`LLMEngine.generate`). Tokens/s counts the tokens each completion really produced (up to and
including eos), the same way for both. Median over `--repeats` runs after one warm-up.

vLLM (when `import vllm` works, e.g. in .venv-vllm after `make test-vllm`): the CPU build, in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, `uni` executor, eager, float32), all B requests in one `LLM.generate`, eos as
a stop token, no detokenizing; its column and `result: tokens_per_s_vs_vllm_bs*` lines (native / vLLM) appear
only then. The RL shape: `--rl-prompts` short prompts (8-16 tokens) with n = 8 samples each.

Clocks: all run single-threaded in this process, so process CPU time (time.process_time) is the
time each would take on a core of its own. This class of machine is 2 cores shared with other
jobs, where wall-clock time mostly measures the neighbours; the table shows both, and the result
lines use CPU time. Runs of the two alternate, so slow phases of the machine hit both alike.

Threads: torch runs with `--threads` (default 1) intra-op threads for both engines, because more
threads than free cores makes both slower and noisier.

Ceiling: the engine multiplies the same weights by only the rows it needs (transformers also keeps
finished sequences in its batch). After the timed runs, one more native run per batch size goes
under torch.profiler; the share of its CPU time spent in matmul kernels (aten::mm/addmm/bmm) gives
the ratio the engine would reach if everything but its matmuls took no time at all:
ceiling = ratio / matmul share. A target above that line needs fewer or faster matmuls (another
dtype, another machine) more than less overhead around them.

Attention, before and after: the engine reads each length class of a step's sequences apart
(rollout/model/attention.py); `attention_length_classes=False` is the path before, one call padded to the longest
context of the step. Both run the same requests on the same model (max_model_len 2048) in three shapes: the RL
batch above (64 prompts of 16-48 tokens), agentic-like contexts (64 prompts of 20-260 tokens) and the long tail
(one prompt of `--long-tail` tokens among 63 of 20). Reported: tokens/s (CPU time) and the largest attention
read workspace (bytes of keys + values one layer reads at once).

    python bench/rollout_throughput.py [--quick] [--threads N]
"""

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import write_tiny_model

EOS = 2


def make_prompts(batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 49, (batch,), generator=gen).tolist()
    return [torch.randint(3, 100, (n,), generator=gen).tolist() for n in lengths]


def run_transformers(model, prompts: list[list[int]], max_tokens: int, seed: int, n: int = 1) -> int:
    """One left-padded generate call (n rows per prompt); returns the tokens generated (each row up to and including
    eos)."""
    prompts = [p for p in prompts for _ in range(n)]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(seed)
    out = model.generate(
        input_ids,
        attention_mask=attention_mask,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=max_tokens,
        pad_token_id=0,
        eos_token_id=EOS,
    )
    generated = 0
    for row in out[:, width:].tolist():
        generated += row.index(EOS) + 1 if EOS in row else len(row)
    return generated


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, seed: int, n: int = 1) -> int:
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i, n=n) for i in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    return sum(len(c.token_ids) for out in outputs for c in out.completions)


def start_vllm(folder, max_num_seqs: int):
    """vLLM's CPU build in this process, or None where vllm is not importable."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    try:
        from vllm import LLM
    except ImportError:
        return None
    return LLM(model=str(folder), dtype="float32", max_model_len=256, max_num_seqs=max_num_seqs, enforce_eager=True,
               distributed_executor_backend="uni", seed=0, enable_prefix_caching=False)


def run_vllm(llm, prompts: list[list[int]], max_tokens: int, seed: int, n: int = 1) -> int:
    from vllm import SamplingParams as VllmParams

    params = [VllmParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i, n=n, stop_token_ids=[EOS],
                         detokenize=False) for i in range(len(prompts))]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(c.token_ids) for out in outputs for c in out.outputs)


def measure(runs: dict, repeats: int) -> dict[str, tuple[float, float]]:
    """Median (cpu, wall) tokens/s of each `fn(seed) -> tokens` in `runs`, alternating, after a warm-up each."""
    for fn in runs.values():
        fn(10_000)
    rates: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    for r in range(repeats):
        for name, fn in runs.items():
            cpu, wall = time.process_time(), time.perf_counter()
            tokens = fn(r)
            rates[name].append((tokens / (time.process_time() - cpu), tokens / (time.perf_counter() - wall)))
    return {name: (statistics.median(c for c, _ in rs), statistics.median(w for _, w in rs)) for name, rs in rates.items()}


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def matmul_share(fn) -> float:
    """Share of `fn()`'s CPU time spent inside matmul kernels, by torch.profiler's self times."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and one repeat (under a minute)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads for both engines")
    parser.add_argument("--max-tokens", type=int, default=None, help="new tokens per completion (default 128, quick 32)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per cell (default 3, quick 1)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rl-prompts", type=int, default=8, help="prompts of the RL shape (n = 8 samples each)")
    parser.add_argument("--long-tail", type=int, default=None, help="the long prompt's tokens (default 1500, quick 600)")
    args = parser.parse_args()
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    repeats = args.repeats or (1 if args.quick else 3)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    folder = write_tiny_model(
        tempfile.mkdtemp(prefix="bench-rollout-") + "/model",
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, seed=0,
    )
    hf_model = AutoModelForCausalLM.from_pretrained(folder).eval()
    max_num_seqs = max(*args.batches, 8 * args.rl_prompts)
    engine = LLMEngine(EngineConfig(model=str(folder), max_model_len=256, max_num_seqs=max_num_seqs, max_n=8))
    vllm = start_vllm(folder, max_num_seqs)
    torch.set_num_threads(args.threads)  # vLLM's CPU worker sets its own

    print(f"tiny qwen2 hidden 256 x 4 layers, head_dim 64, float32, CPU, {args.threads} thread(s), "
          f"up to {max_tokens} new tokens, median of {repeats}")
    shapes = {f"{b}": (make_prompts(b, seed=b), 1) for b in args.batches}
    gen = torch.Generator().manual_seed(8)
    shapes[f"rl {args.rl_prompts}x8"] = ([torch.randint(3, 100, (int(n),), generator=gen).tolist()
                                          for n in torch.randint(8, 17, (args.rl_prompts,), generator=gen)], 8)
    print(f"{'shape':>8} | {'native tok/s cpu (wall)':>23} | {'transformers tok/s cpu (wall)':>29} | "
          f"{'ratio cpu (wall)':>16} | {'matmul share':>12} | {'ceiling':>7}" + (" | vLLM tok/s cpu (wall) | native/vLLM cpu"
                                                                              if vllm else ""))
    ratios, ceilings, vs_vllm = {}, {}, {}
    for shape, (prompts, n) in shapes.items():
        runs = {"native": lambda s, p=prompts, n=n: run_engine(engine, p, max_tokens, s, n),
                "hf": lambda s, p=prompts, n=n: run_transformers(hf_model, p, max_tokens, s, n)}
        if vllm is not None:
            runs["vllm"] = lambda s, p=prompts, n=n: run_vllm(vllm, p, max_tokens, s, n)
        with torch.inference_mode():
            rates = measure(runs, repeats)
            share = matmul_share(lambda p=prompts, n=n: run_engine(engine, p, max_tokens, 20_000, n))
        (native_cpu, native_wall), (hf_cpu, hf_wall) = rates["native"], rates["hf"]
        ratios[shape] = native_cpu / hf_cpu
        ceilings[shape] = ratios[shape] / share
        line = (f"{shape:>8} | {native_cpu:>11.0f} ({native_wall:>9.0f}) | {hf_cpu:>17.0f} ({hf_wall:>9.0f}) | "
                f"{ratios[shape]:>7.2f} ({native_wall / hf_wall:>6.2f}) | {share:>12.2f} | {ceilings[shape]:>7.2f}")
        if vllm is not None:
            vllm_cpu, vllm_wall = rates["vllm"]
            vs_vllm[shape] = native_cpu / vllm_cpu
            line += f" | {vllm_cpu:>9.0f} ({vllm_wall:>9.0f}) | {vs_vllm[shape]:>15.2f}"
        print(line)
    print("matmul share = the native engine's CPU time in matmul kernels (torch.profiler, one more run); ceiling = "
          "ratio / matmul share, the ratio with everything but those matmuls free")
    for shape, ratio in ratios.items():
        name = shape.replace(" ", "_") if shape.startswith("rl") else f"bs{shape}"
        target = ">= 3" if shape == "64" else "none"
        print(f"result: tokens_per_s_ratio_{name} = {ratio:.2f} (baseline transformers generate, CPU time, "
              f"target {target}; ceiling with its matmuls alone: {ceilings[shape]:.2f})")
    for shape, ratio in vs_vllm.items():
        name = shape.replace(" ", "_") if shape.startswith("rl") else f"bs{shape}"
        print(f"result: tokens_per_s_vs_vllm_{name} = {ratio:.2f} (baseline vLLM CPU build, eager, one process, "
              f"CPU time, target >= 1)")
    if vllm is None:
        print("vLLM not importable here: no vLLM column (run from .venv-vllm, see `make test-vllm`)")
    long_folder = write_tiny_model(
        tempfile.mkdtemp(prefix="bench-rollout-") + "/model",
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, seed=0, max_position_embeddings=2048,
    )
    attention_shapes(long_folder, args.quick, args.long_tail or (600 if args.quick else 1500), repeats)

def attention_shapes(folder, quick: bool, long_tail: int, repeats: int) -> None:
    """Length classes vs one padded call, same engine otherwise; see the module docstring."""
    engines = {name: LLMEngine(EngineConfig(model=str(folder), max_model_len=2048, max_num_seqs=64, max_n=1,
                                            attention_length_classes=classes))
               for name, classes in (("classes", True), ("padded", False))}
    gen = torch.Generator().manual_seed(7)

    def prompts(lengths: list[int]) -> list[list[int]]:
        return [torch.randint(3, 100, (n,), generator=gen).tolist() for n in lengths]

    shapes = {
        "rl: 64 x 16-48": (prompts(torch.randint(16, 49, (64,), generator=gen).tolist()), 16 if quick else 64),
        "agentic: 64 x 20-260": (prompts(torch.randint(20, 261, (64,), generator=gen).tolist()), 8 if quick else 32),
        f"long tail: 1 x {long_tail} + 63 x 20": (prompts([long_tail] + [20] * 63), 8 if quick else 32),
    }
    print("\nattention: length classes (now) vs one call padded to the longest context (before), max_model_len 2048")
    print(f"{'shape':>28} | {'classes tok/s':>13} | {'padded tok/s':>12} | {'ratio':>5} | {'workspace classes':>17} | "
          f"{'padded':>9}")
    figures = {}
    for shape, (batch, max_tokens) in shapes.items():
        runs = {}
        for name, engine in engines.items():
            engine.runner.cache._workspace = None

            def run(seed, engine=engine, batch=batch, max_tokens=max_tokens):
                params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i, ignore_eos=True)
                          for i in range(len(batch))]
                return sum(len(c.token_ids) for out in engine.generate(batch, params) for c in out.completions)

            runs[name] = run
        with torch.inference_mode():
            rates = measure(runs, repeats)
        workspace = {name: sum(buf.nbytes for buf in engine.runner.cache._workspace) for name, engine in engines.items()}
        ratio = rates["classes"][0] / rates["padded"][0]
        figures[shape] = (ratio, workspace["padded"] / workspace["classes"])
        print(f"{shape:>28} | {rates['classes'][0]:>13.0f} | {rates['padded'][0]:>12.0f} | {ratio:>5.2f} | "
              f"{workspace['classes'] / 2**20:>14.2f} MB | {workspace['padded'] / 2**20:>6.2f} MB")
    for shape, (ratio, memory) in figures.items():
        name = shape.split(":")[0].replace(" ", "_")
        print(f"result: attention_{name}_tokens_per_s = {ratio:.2f} (baseline the same engine with one attention "
              f"call padded to the longest context, target >= 1)")
        print(f"result: attention_{name}_workspace_reduction = {memory:.1f} (baseline the same, target > 1 when "
              f"lengths differ)")


if __name__ == "__main__":
    main()
