"""The engine's stage report: where the engine thread's time goes, interval by interval, with no "other" bucket.

The engine thread is always in exactly one stage; `switch` moves it on and charges the time since the last switch
to the stage it leaves, so an interval's stages sum to it. The stages:

- idle: nothing to run (waiting for a request or a command);
- prefill, decode: engine steps (LLMEngine.step: scheduling, the forward, sampling, post-processing). A step that
  computes both prompt chunks and decodes splits its time between them by their share of its tokens; the prefill
  worker's prefills for transfer count as prefill;
- weight_switch: loading new weights between two steps (the engines' pause, seen from inside);
- commands: the rest of the thread's work: the callers' commands (adding and aborting requests, logprob scoring,
  session operations) and handing each step's tokens to their callers.

Beside the times, per interval: the tokens each step kind computed, queue waits (from a sequence's arrival to the
step that first schedules it), KV occupancy (used blocks over all, averaged over steps and at its peak), and the
steps' matmul FLOPs (services/flops.py, the trainer's model). Every sequence also gets its times (arrival, first
scheduled, first token, finished: `Sequence.timing`), which a traced request's engine spans are made from.
`report()` is called from another thread (the stage report writer, services/stage_reports.py): a lock guards the
tallies.
"""

import threading
import time

from torch import nn

from rollout.engine.scheduler import Batch
from services.flops import FlopModel

STAGES = ("idle", "prefill", "decode", "weight_switch", "commands")


class EngineStepStats:
    def __init__(self, flop_model: FlopModel | None, num_blocks: int) -> None:
        self.flop_model = flop_model
        self.num_blocks = num_blocks
        self.num_prefill_tokens = 0  # since the engine started (the prefill_tokens gauge)
        self.current = "idle"
        self._since = time.perf_counter()
        self._lock = threading.Lock()
        self._step_tokens = (0, 0)  # (prefill, decode) tokens of the step running now
        self._reset()

    def _reset(self) -> None:
        self.totals = dict.fromkeys(STAGES, 0.0)
        self.prefill_tokens = self.decode_tokens = self.steps = 0
        self.flops = 0.0
        self.queue_waits: list[float] = []
        self.kv_used_sum = 0.0
        self.kv_used_peak = 0.0

    def switch(self, stage: str) -> None:
        now = time.perf_counter()
        with self._lock:
            self._charge(now)
            self.current = stage
            if stage == "step":
                self._step_tokens = (0, 0)  # batch() sets them; a step that schedules nothing is decode's

    def _charge(self, now: float) -> None:
        seconds, self._since = now - self._since, now
        if self.current != "step":
            self.totals[self.current] += seconds
            return
        prefill, decode = self._step_tokens  # a step's time split by its tokens
        share = prefill / (prefill + decode) if prefill + decode else 0.0
        self.totals["prefill"] += seconds * share
        self.totals["decode"] += seconds * (1.0 - share)

    def batch(self, batch: Batch, free_blocks: int) -> None:
        """A step is about to compute `batch`: count its tokens, FLOPs, first schedulings and the KV in use."""
        now_ns = time.time_ns()
        prefill = decode = attended = 0
        for seq in batch.seqs:
            computed = batch.num_new_tokens.get(seq.seq_id, 0)
            attended += computed * seq.num_cached_tokens + computed * (computed + 1) // 2
            if seq.timing[1] is None:
                seq.timing[1] = now_ns
                self.queue_waits.append((now_ns - seq.timing[0]) / 1e9)
            if not seq.prefilling or (computed == 1 and seq.num_output_tokens > 0):  # a sampled token fed back
                decode += computed
                continue
            prefill += computed
            if seq.session is not None:
                seq.session.prefill_tokens += computed
                seq.session.turn_prefill_tokens[-1] += computed
        used = 1.0 - free_blocks / self.num_blocks if self.num_blocks else 0.0
        with self._lock:
            self.num_prefill_tokens += prefill
            self._step_tokens = (prefill, decode)
            self.prefill_tokens += prefill
            self.decode_tokens += decode
            self.steps += 1
            if self.flop_model is not None:
                self.flops += self.flop_model.tokens(prefill + decode, attended)
            self.kv_used_sum += used
            self.kv_used_peak = max(self.kv_used_peak, used)

    def sampled(self, seqs) -> None:
        """After a step: the first token and the end of the sequences that sampled; the step's time is charged."""
        now_ns = time.time_ns()
        for seq in seqs:
            if seq.timing[2] is None:
                seq.timing[2] = now_ns
            if seq.is_finished:
                seq.timing[3] = now_ns
        self.switch("commands")

    def report(self) -> dict[str, float]:
        """The interval since the last report in the stage-report form (services/stage_reports.py): `stage/<name>_s`
        (summing to `stage/interval_s`), `engine/*` (tokens, steps, queue waits, KV occupancy), `perf/flops`;
        resets the tallies."""
        now = time.perf_counter()
        with self._lock:
            self._charge(now)
            report = {f"stage/{stage}_s": seconds for stage, seconds in self.totals.items()}
            waits = self.queue_waits
            report.update({
                "stage/interval_s": sum(self.totals.values()), "engine/steps": self.steps,
                "engine/prefill_tokens": self.prefill_tokens, "engine/decode_tokens": self.decode_tokens,
                "engine/queue_wait_mean_s": sum(waits) / len(waits) if waits else 0.0,
                "engine/queue_wait_max_s": max(waits, default=0.0), "engine/scheduled": len(waits),
                "engine/kv_used_mean": self.kv_used_sum / self.steps if self.steps else 0.0,
                "engine/kv_used_peak": self.kv_used_peak,
            })
            if self.flop_model is not None:
                report["perf/flops"] = self.flops
            self._reset()
        return report

def engine_flop_model(model: nn.Module, config) -> FlopModel:
    """The FLOP model of the engine's model: every matrix it multiplies a token by (a tied head: the embedding)."""
    linear = sum(p.numel() for name, p in model.named_parameters()
                 if p.dim() >= 2 and "embed_tokens" not in name and ".visual." not in f".{name}")
    if config.tie_word_embeddings:
        linear += config.vocab_size * config.hidden_size
    return FlopModel(linear, config.num_layers, config.num_heads * config.head_dim)
