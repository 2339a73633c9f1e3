"""Generated tokens/s on image prompts: the native engine vs transformers `generate`, the same tiny VLM.

Workload: the tiny-model kit's Qwen2.5-VL (`write_tiny_model(arch="qwen2_5_vl")`: hidden 128, 2 layers, a 2-block
vision tower), float32, CPU, 1 torch thread; each prompt is the same 16 tokens of text around one image of its own
(84 x 56 pixels of noise: 6 image tokens), 32 new tokens, greedy, eos ignored.

- engine: `LLMEngine.generate` over the prompts with their images (vision tower at prefill, M-RoPE, paged KV).
- baseline: transformers `Qwen2_5_VLForConditionalGeneration.generate` with the processor's pixel values and grids,
  at the same batch size (equal-length prompts: no padding).

Batch 1 (prompts one at a time) and batch 16 (16 prompts together); runs alternate, medians of process CPU time per
generated token (the 2 cores here are shared: wall time measures the neighbours too).

    python bench/vlm_generate.py [--quick]
"""

import argparse
import functools
import hashlib
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from PIL import Image
from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.multimodal import ImageInput
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import write_tiny_model

NEW_TOKENS = 32
VISION_START, VISION_END, IMAGE_PAD = 101, 102, 103  # the kit's vision tokens


def make_images(folder, count: int) -> list[ImageInput]:
    processor = AutoImageProcessor.from_pretrained(folder)
    images = []
    for seed in range(count):
        pixels = torch.randint(0, 256, (56, 84, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
        processed = processor(images=[Image.fromarray(pixels.numpy())], return_tensors="pt")
        images.append(ImageInput(processed["pixel_values"], tuple(int(n) for n in processed["image_grid_thw"][0]),
                                 hashlib.sha256(pixels.numpy().tobytes()).digest()))
    return images


def engine_batches(engine: LLMEngine, params: SamplingParams, prompt: list[int], images: list[ImageInput],
                   groups: list[list[int]]) -> None:
    for group in groups:
        engine.generate([prompt] * len(group), params, [[images[i]] for i in group])


def transformers_batches(model, prompt: list[int], images: list[ImageInput], groups: list[list[int]]) -> None:
    for group in groups:
        ids = torch.tensor([prompt] * len(group))
        with torch.no_grad():
            model.generate(input_ids=ids, pixel_values=torch.cat([images[i].pixel_values for i in group]),
                           image_grid_thw=torch.tensor([list(images[i].grid_thw) for i in group]),
                           mm_token_type_ids=(ids == IMAGE_PAD).int(), max_new_tokens=NEW_TOKENS,
                           min_new_tokens=NEW_TOKENS, do_sample=False)


def cpu_seconds(run) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round, fewer prompts (a smoke run)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds, prompts_per_batch = (1, {1: 2, 16: 16}) if args.quick else (3, {1: 8, 16: 32})
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_model(f"{tmp}/vlm", arch="qwen2_5_vl")
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()
        engine = LLMEngine(EngineConfig(model=folder, dtype="float32", max_model_len=128, max_num_seqs=16,
                                        enable_prefix_caching=False))
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        print(f"load average {os.getloadavg()[0]:.1f}")
        for batch, count in prompts_per_batch.items():
            images = make_images(folder, count)
            prompt = [1, *range(40, 47), VISION_START, *[IMAGE_PAD] * images[0].num_tokens(2), VISION_END,
                      *range(60, 67)]
            groups = [list(range(i, min(i + batch, count))) for i in range(0, count, batch)]

            run_engine = functools.partial(engine_batches, engine, params, prompt, images, groups)
            run_transformers = functools.partial(transformers_batches, model, prompt, images, groups)
            run_engine()  # warm-up: first calls allocate
            times = {"engine": [], "transformers": []}
            for _ in range(rounds):
                times["engine"].append(cpu_seconds(run_engine))
                times["transformers"].append(cpu_seconds(run_transformers))
            tokens = count * NEW_TOKENS
            engine_rate = tokens / statistics.median(times["engine"])
            hf_rate = tokens / statistics.median(times["transformers"])
            print(f"result: vlm_engine_tokens_per_cpu_s_batch{batch} = {engine_rate:.0f} (baseline transformers "
                  f"generate {hf_rate:.0f}; ratio {engine_rate / hf_rate:.2f}; {count} image prompts, {NEW_TOKENS} "
                  f"tokens each)")


if __name__ == "__main__":
    main()
