"""How far the rollout's logprobs are from the trainer's, by engine dtype and LM head precision.

The native engine generates in float32 (the engine's default on CUDA before issue 34, and on the CPU still), in
bfloat16 with its LM head in bfloat16 (the default on an accelerator since) and in float32 (`engine.lm_head_fp32`,
made from the checkpoint's own tensor when that is float32: `--checkpoint-dtype float32`); the trainer's reference is
the same checkpoint in float32 (transformers, teacher-forced on the sampled tokens at the sampling temperature), what
a float32 trainer or one with `model.lm_head_fp32` computes. The engines sample the same tokens where they can (same
seeds); each is scored on its own tokens. Printed: mean and max |rollout - reference logprob| and the k3 KL per row,
and their ratios.

    python bench/logprob_mismatch.py [--quick] [--shape wide_vocab|small] [--device cpu|cuda] [--checkpoint-dtype D]
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from qwen_shape import SHAPES, build_model

ROWS = {"float32": ("float32", False), "bfloat16": ("bfloat16", False), "bfloat16 + fp32 head": ("bfloat16", True)}


def mismatch(folder: Path, dtype: str, head_fp32: bool, prompts: list[list[int]], tokens: int, temperature: float,
             device: str) -> dict:
    engine = LLMEngine(EngineConfig(model=str(folder), dtype=dtype, lm_head_fp32=head_fp32, max_model_len=512,
                                    device=device))
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True, seed=7)
    outputs = engine.generate(prompts, params)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(device)
    gaps, k3 = [], []
    with torch.no_grad():
        for output in outputs:
            completion = output.completions[0]
            ids = torch.tensor([output.prompt_ids + completion.token_ids], device=device)
            logits = reference(ids).logits[0, len(output.prompt_ids) - 1 : -1].float().cpu() / temperature
            expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion.token_ids)[:, None])[:, 0]
            diff = expected - torch.tensor(completion.logprobs)
            gaps.append(diff.abs())
            k3.append(torch.expm1(diff) - diff)
    gap, k3_all = torch.cat(gaps), torch.cat(k3)
    return {"abs_mean": float(gap.mean()), "abs_max": float(gap.max()), "k3": float(k3_all.mean()), "tokens": gap.numel()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer prompts and tokens (under a minute)")
    parser.add_argument("--shape", default="wide_vocab", choices=sorted(SHAPES))
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--device", default="cpu", help="where the engines and the reference run (cpu, cuda)")
    parser.add_argument("--checkpoint-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the published weights' dtype (float32: the fp32 head is made from them, unrounded)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    count, tokens = (4, 16) if args.quick else (16, 48)
    prompts = [[1, *range(10 + i, 26 + i)] for i in range(count)]
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_model(Path(tmp) / "model", args.shape, args.checkpoint_dtype, args.device, 512, head_scale=4.0)
        rows = {name: mismatch(folder, dtype, head, prompts, tokens, args.temperature, args.device)
                for name, (dtype, head) in ROWS.items()}
    print(f"\nengine vs float32 reference on {args.device}, {args.shape} (vocabulary "
          f"{SHAPES[args.shape]['vocab_size']:,}), {args.checkpoint_dtype} checkpoint, T={args.temperature}")
    print(f"{'engine':>21} {'tokens':>7} {'mean |d|':>10} {'max |d|':>9} {'k3':>10}")
    for name, row in rows.items():
        print(f"{name:>21} {row['tokens']:>7} {row['abs_mean']:>10.4g} {row['abs_max']:>9.4g} {row['k3']:>10.4g}")
    fp32, bf16, head = rows["float32"], rows["bfloat16"], rows["bfloat16 + fp32 head"]
    print(f"result: bf16_default_abs_mean = {bf16['abs_mean']:.4g} (baseline the float32 engine, the old default: "
          f"{fp32['abs_mean']:.4g}; max |d| {bf16['abs_max']:.4g} vs {fp32['abs_max']:.4g})")
    print(f"result: fp32_head_vs_bf16_head_abs_mean = {head['abs_mean'] / bf16['abs_mean']:.3f} (baseline the bf16 "
          f"head: mean |d| {bf16['abs_mean']:.4g}, float32 head {head['abs_mean']:.4g}; lower is closer to the trainer)")
    print(f"result: fp32_head_vs_bf16_head_k3 = {head['k3'] / bf16['k3']:.3f} (baseline the bf16 head: k3 "
          f"{bf16['k3']:.4g}, float32 head {head['k3']:.4g})")


if __name__ == "__main__":
    main()
