"""Generated tokens/s: the native engine vs transformers `generate`, same tiny model, same prompts.

Model: a tiny Qwen2 (hidden 256, 4 layers, 4 heads / 2 kv heads, head_dim 64, char vocabulary),
float32, CPU. Workload per batch size B: B prompts of 16-48 tokens, sampled at temperature 1
(no top-k/top-p), up to `--max-tokens` new tokens each, stopping at eos as a real rollout does.
transformers gets the prompts left-padded in one `generate` call; the engine gets B requests at
once (`LLMEngine.generate`). Tokens/s counts the tokens each completion really produced (up to and
including eos), the same way for both. Median over `--repeats` runs after one warm-up.

Clocks: both run single-threaded in this process, so process CPU time (time.process_time) is the
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
(rollout/attention.py); `attention_length_classes=False` is the path before, one call padded to the longest
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
from rollout.engine import LLMEngine
from rollout.sampling_params import SamplingParams
from rollout.tiny import write_tiny_model

EOS = 2


def make_prompts(batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(16, 49, (batch,), generator=gen).tolist()
    return [torch.randint(3, 100, (n,), generator=gen).tolist() for n in lengths]


def run_transformers(model, prompts: list[list[int]], max_tokens: int, seed: int) -> int:
    """One left-padded generate call; returns the tokens generated (each row up to and including eos)."""
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


def run_engine(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, seed: int) -> int:
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i) for i in range(len(prompts))]
    outputs = engine.generate(prompts, params)
    return sum(len(c.token_ids) for out in outputs for c in out.completions)


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
    engine = LLMEngine(EngineConfig(model=str(folder), max_model_len=256, max_num_seqs=max(args.batches), max_n=1))

    print(f"tiny qwen2 hidden 256 x 4 layers, head_dim 64, float32, CPU, {args.threads} thread(s), "
          f"up to {max_tokens} new tokens, median of {repeats}")
    print(f"{'batch':>5} | {'native tok/s cpu (wall)':>23} | {'transformers tok/s cpu (wall)':>29} | "
          f"{'ratio cpu (wall)':>16} | {'matmul share':>12} | {'ceiling':>7}")
    ratios, ceilings = {}, {}
    for batch in args.batches:
        prompts = make_prompts(batch, seed=batch)
        with torch.inference_mode():
            rates = measure({
                "native": lambda s, p=prompts: run_engine(engine, p, max_tokens, s),
                "hf": lambda s, p=prompts: run_transformers(hf_model, p, max_tokens, s),
            }, repeats)
            share = matmul_share(lambda p=prompts: run_engine(engine, p, max_tokens, 20_000))
        (native_cpu, native_wall), (hf_cpu, hf_wall) = rates["native"], rates["hf"]
        ratios[batch] = native_cpu / hf_cpu
        ceilings[batch] = ratios[batch] / share
        print(f"{batch:>5} | {native_cpu:>11.0f} ({native_wall:>9.0f}) | {hf_cpu:>17.0f} ({hf_wall:>9.0f}) | "
              f"{ratios[batch]:>7.2f} ({native_wall / hf_wall:>6.2f}) | {share:>12.2f} | {ceilings[batch]:>7.2f}")
    print("matmul share = the native engine's CPU time in matmul kernels (torch.profiler, one more run); ceiling = "
          "ratio / matmul share, the ratio with everything but those matmuls free")
    for batch, ratio in ratios.items():
        target = ">= 3" if batch == 64 else "none"
        print(f"result: tokens_per_s_ratio_bs{batch} = {ratio:.2f} (baseline transformers generate, CPU time, "
              f"target {target}; ceiling with its matmuls alone: {ceilings[batch]:.2f})")
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
