"""KV compression, measured per method on one model and one prompt set: KV bytes per token (resident and on the
wire) against the uncompressed cache, sequences that fit a fixed KV budget, greedy-token agreement, mean |logprob
difference| and KL against the uncompressed cache, and task accuracy on the quickstart's held-out set.

Model: the quickstart's (tiny Qwen2: hidden 128, 2 layers, 2 kv heads, head_dim 32, float32), its project written
(deploy/experiment/quickstart.py) and SFT-warmed exactly as its experiment file does (deploy/runs/experiment_run.py `warm_up`:
450 steps of batch 64, lr 1e-3; --sft-steps), kept in --model-dir and reused by later runs (building it takes ~40 s
here). Prompts: the quickstart's 200 held-out 2-digit additions (the project's eval.jsonl, seed 0), never trained on.

- resident B/tok: bytes per token of a cache block as stored (EngineConfig.kv_bytes_per_block / block_size, block 16);
  the float pool of open blocks (one per running sequence) is not in it, it is in "seqs in budget".
- wire B/tok: the codec of rollout/kv/codecs.py (key groups of 64 tokens) on the KV of 256 tokens.
- seqs in budget: the most sequences of max_model_len=512 tokens whose blocks, and their open float blocks, fit
  64 MiB (checked against EngineConfig's own num_blocks); with eviction a sequence holds at most its budget (128
  tokens) plus the block that triggers its compaction.
- agree, |dlogp|, KL: every method is teacher-forced along the uncompressed cache's greedy tokens (4 new tokens, the
  quickstart's max_tokens) through the engine's own decode path (its sampler swapped for one that returns the forced
  token and keeps the full log-softmax); per position: argmax equal to the forced token, |logprob of the forced
  token - the uncompressed one|, KL(uncompressed || method) over the whole vocabulary; means over positions.
  Measured at block_size 4: with the quickstart's 6-10 token contexts and block 16 nothing would be quantized (a
  block is quantized when it is full; the block being filled stays in full precision, KIVI's residual).
- acc bs4 / acc bs16: held-out greedy exact match (the reward's rule, reward.match) with block_size 4 and 16.

Methods are EngineConfig overrides (METHODS below); eviction settings are added there as further entries.

    python bench/kv_compression.py [--quick] [--model-dir DIR] [--sft-steps N]
"""

import argparse
import os
import pathlib
import time
from dataclasses import dataclass, field

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

from deploy.experiment import data as experiment_data
from deploy.experiment.quickstart import write_project
from deploy.experiment.schema import load_experiment
from deploy.record.progress import Progress
from deploy.rl.plan import base_model
from deploy.runs.experiment_run import warm_up
from reward.match import extract_answer, normalize
from rollout.config import EngineConfig
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.kv.codecs import make_codec

BUDGET_BYTES = 64 << 20
MAX_MODEL_LEN = 512
WIRE_TOKENS = 256
QUALITY_BLOCK_SIZE = 4


@dataclass(frozen=True)
class Method:
    name: str
    overrides: dict = field(default_factory=dict)  # EngineConfig fields
    wire_codec: str = "none"  # the codec of the same compression on the wire (rollout/kv/codecs.py)
    quality: dict = field(default_factory=dict)  # overrides of `overrides` for the quality columns only


# Eviction keeps 128 of 512 tokens for the capacity column. The quickstart's contexts are 8-11 tokens, which a
# 128-token budget never touches: the quality columns evict at a budget of 4 slots (1 sink, the last 2 always
# kept), compacted when a sequence reaches 8 (block 4): the answer's later tokens see 4 of the prompt's 7 plus
# what followed.
EVICT = {"kv_budget_tokens": 128, "kv_sink_tokens": 4, "kv_observation_window": 16}
EVICT_QUALITY = {"kv_budget_tokens": 4, "kv_sink_tokens": 1, "kv_observation_window": 2}


METHODS = [
    Method("none"),
    Method("int8", {"kv_cache_dtype": "int8"}, "int8"),
    Method("int4", {"kv_cache_dtype": "int4"}, "int4"),
    Method("window", {"kv_eviction": "window", **EVICT}, quality=EVICT_QUALITY),
    Method("snapkv", {"kv_eviction": "snapkv", **EVICT}, quality=EVICT_QUALITY),
    Method("int4+snapkv", {"kv_cache_dtype": "int4", "kv_eviction": "snapkv", **EVICT}, "int4", quality=EVICT_QUALITY),
]


class ForcedSampler:
    """Stands in for the engine's sampler on one sequence: returns the forced token, keeps every row's log-softmax."""

    def __init__(self, forced: list[int]):
        self.forced = forced
        self.rows: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, tensors) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        token = self.forced[len(self.rows)]
        self.rows.append(logprobs[0].clone())
        return torch.tensor([token]), logprobs[0, token].reshape(1)


def trained_model(model_dir: pathlib.Path, sft_steps: int) -> tuple[pathlib.Path, list]:
    """The quickstart's model after `sft_steps` of its SFT warm-up, made once in model_dir, and its held-out rows
    (deploy.experiment.data.PromptRow)."""
    from transformers import AutoTokenizer

    config = load_experiment(write_project(model_dir / "project"), [f"sft.steps={sft_steps}"])
    run_dir = model_dir / f"sft-{sft_steps}"  # a warm-up whole there is kept (resume)
    run_dir.mkdir(parents=True, exist_ok=True)
    start = base_model(config, run_dir, resume=True)
    tokenizer = AutoTokenizer.from_pretrained(start)
    train_rows, eval_rows = experiment_data.split(config.data, tokenizer, config.seed)
    return warm_up(config, start, run_dir, tokenizer, train_rows, Progress(run_dir), resume=True), eval_rows


def engine(model: pathlib.Path, method: Method, block_size: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model), block_size=block_size, num_blocks=4096, max_model_len=64,
                                  max_num_seqs=256, max_num_batched_tokens=4096,
                                  **{**method.overrides, **method.quality}))


def seqs_in_budget(model: pathlib.Path, method: Method) -> int:
    """The most sequences of MAX_MODEL_LEN tokens a BUDGET_BYTES cache holds (blocks and open float blocks)."""
    probe = EngineConfig(model=str(model), max_model_len=MAX_MODEL_LEN, max_num_seqs=1, max_n=1, **method.overrides)
    blocks_per_seq = -(-MAX_MODEL_LEN // probe.block_size)
    if probe.kv_eviction != "none":  # at most the budget plus the block that triggers its compaction
        blocks_per_seq = min(blocks_per_seq, -(-(probe.kv_budget_tokens + probe.block_size) // probe.block_size))
    open_bytes = probe.kv_float_bytes_per_block if probe.kv_open_blocks else 0
    count = BUDGET_BYTES // (blocks_per_seq * probe.kv_bytes_per_block + open_bytes)
    for seqs in (count, count + 1):  # EngineConfig agrees: count fit, count + 1 do not
        config = EngineConfig(model=str(model), max_model_len=MAX_MODEL_LEN, max_num_seqs=seqs, max_n=1,
                              max_num_batched_tokens=max(seqs, 4096), kv_cache_memory_bytes=BUDGET_BYTES,
                              **method.overrides)
        assert (config.num_blocks >= seqs * blocks_per_seq) == (seqs == count), (method.name, seqs, config.num_blocks)
    return count


def forced_logprobs(llm: LLMEngine, prompts: list[list[int]], references: list[list[int]]) -> list[torch.Tensor]:
    """[len(reference), vocab] log-softmax of each prompt's positions, the engine fed the reference tokens."""
    rows = []
    real_sampler = llm.runner.sampler
    for prompt, reference in zip(prompts, references):
        llm.runner.sampler = ForcedSampler(reference)
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=len(reference), ignore_eos=True))
        rows.append(torch.stack(llm.runner.sampler.rows))
    llm.runner.sampler = real_sampler
    return rows


def accuracy(llm: LLMEngine, prompts: list[list[int]], answers: list[str], tokenizer) -> tuple[float, list[list[int]]]:
    """Greedy exact match over the prompts (4 new tokens, as the quickstart), and the tokens generated."""
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    tokens = [output.completions[0].token_ids for output in outputs]
    correct = sum(normalize(extract_answer(tokenizer.decode(ids, skip_special_tokens=True))) == normalize(answer)
                  for ids, answer in zip(tokens, answers))
    return correct / len(prompts), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 of the held-out prompts")
    parser.add_argument("--model-dir", default="/tmp/relayrl-bench-kv-compression", help="where the SFT model is kept")
    parser.add_argument("--sft-steps", type=int, default=450, help="SFT steps (the quickstart's 450)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sft_steps = args.sft_steps
    started = time.monotonic()
    model, eval_rows = trained_model(pathlib.Path(args.model_dir), sft_steps)
    print(f"model: {model} (quickstart SFT, {sft_steps} steps; ready after {time.monotonic() - started:.0f} s)")
    if args.quick:
        eval_rows = eval_rows[:64]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [experiment_data.prompt_ids(row, tokenizer, add_bos=True) for row in eval_rows]
    answers = [str(row.metadata["answer"]) for row in eval_rows]

    reference_engine = engine(model, METHODS[0], QUALITY_BLOCK_SIZE)
    _, references = accuracy(reference_engine, prompts, answers, tokenizer)
    reference_rows = forced_logprobs(reference_engine, prompts, references)
    m = reference_engine.model_config
    wire_shape = (m.num_layers, WIRE_TOKENS, m.num_kv_heads, m.head_dim)
    rows = {}
    for method in METHODS:
        config = EngineConfig(model=str(model), max_model_len=MAX_MODEL_LEN, **method.overrides)
        resident = config.kv_bytes_per_block / config.block_size
        wire = make_codec(method.wire_codec).encoded_nbytes(wire_shape, config.torch_dtype) / WIRE_TOKENS
        quality = engine(model, method, QUALITY_BLOCK_SIZE)
        forced = forced_logprobs(quality, prompts, references)
        agree, diffs, kls = [], [], []
        for ours, theirs, reference in zip(forced, reference_rows, references):
            targets = torch.tensor(reference).unsqueeze(1)
            agree += (ours.argmax(-1) == targets.squeeze(1)).tolist()
            diffs += (ours.gather(1, targets) - theirs.gather(1, targets)).abs().squeeze(1).tolist()
            kls += (theirs.exp() * (theirs - ours)).sum(-1).tolist()
        acc4, _ = accuracy(quality, prompts, answers, tokenizer)
        acc16, _ = accuracy(engine(model, method, 16), prompts, answers, tokenizer)
        rows[method.name] = {"resident": resident, "wire": wire, "seqs": seqs_in_budget(model, method),
                                 "agree": sum(agree) / len(agree), "diff": sum(diffs) / len(diffs), "kl": sum(kls) / len(kls),
                                 "acc4": acc4, "acc16": acc16}
    base = rows["none"]
    print(f"\n{len(prompts)} held-out prompts, {sum(map(len, references))} forced positions; KV budget "
          f"{BUDGET_BYTES >> 20} MiB at max_model_len {MAX_MODEL_LEN}\n")
    header = (f"{'method':<12} {'resident B/tok':>14} {'x':>5} {'wire B/tok':>10} {'x':>5} {'seqs in budget':>14} "
              f"{'x':>5} {'agree':>6} {'|dlogp|':>8} {'KL':>9} {'acc bs4':>7} {'acc bs16':>8}")
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        print(f"{name:<12} {r['resident']:>14.1f} {base['resident'] / r['resident']:>5.2f} {r['wire']:>10.1f} "
              f"{base['wire'] / r['wire']:>5.2f} {r['seqs']:>14d} {r['seqs'] / base['seqs']:>5.2f} {r['agree']:>6.3f} "
              f"{r['diff']:>8.4f} {r['kl']:>9.2e} {r['acc4']:>7.3f} {r['acc16']:>8.3f}")
    print()
    for name, r in rows.items():
        if name == "none":
            continue
        print(f"result: kv_seqs_in_budget_ratio_{name} = {r['seqs'] / base['seqs']:.2f} (baseline uncompressed cache "
              f"{base['seqs']} seqs, target >= 4 with int4 + eviction)")
        print(f"result: greedy_agreement_{name} = {r['agree']:.3f} (baseline uncompressed cache, target >= 0.99 int8)")
        print(f"result: accuracy_cost_{name} = {base['acc4'] - r['acc4']:+.3f} (baseline uncompressed cache "
              f"{base['acc4']:.3f} at block_size 4, target reported)")
    print(f"\nwall: {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
