"""A bounded, sampled log of scored groups for `relayrl view RUN_DIR` (deploy/inspect/view.py): one JSON line per group.

    producer: log.wants(group_index)? -> log.offer(group_index, build)      (never waits: a full queue drops it)
    writer thread: build(spell) -> a JSON line -> appended, the file kept under max_bytes

Every `every_n_groups`-th group of the producer's stream (its group index) is kept. Turning a group into its
line (token ids to lists, each token spelled by the tokenizer, JSON) runs on the writer thread, never in the
producer's event loop. The file never passes `max_bytes`: when the next line would, the log keeps every other
group it holds (the stride doubles) and goes on at the wider stride, so it covers the whole run, evenly, within
its bound. A restarted producer appends to the same file and thins it the same way.
"""

import base64
import json
import logging
import os
import pathlib
import queue
import re
import threading
from collections.abc import Callable, Sequence

from pydantic import Field

from protos.sample import Sample
from services.config import Strict

log = logging.getLogger("relayrl.trajectories")
Spell = Callable[[Sequence[int]], list[str]]  # token ids -> each token's text
_INDEX = re.compile(rb'^\{"group_index": (\d+)')  # every line starts so (see `group_line`)


class TrajectoryLogConfig(Strict):
    """Which groups a producer keeps for the viewer, and how much of them."""

    path: str | None = Field(None, description="The JSONL file (RUN_DIR/trajectories.jsonl in a run); None = none.")
    every_n_groups: int = Field(10, ge=0, description="Keep every n-th group of the stream; 0 = no log.")
    max_bytes: int = Field(16 << 20, ge=1 << 12, description="The file's bound: past it the log keeps every other "
                           "group it holds and samples half as often from then on.")
    queue_groups: int = Field(64, ge=1, description="Groups waiting for the writer thread; beyond it a group is "
                              "skipped (counted), never waited for.")
    tokenizer: str | None = Field(None, description="Tokenizer folder that spells each token for the viewer's "
                                  "coloured tokens; None = the driver's own (the runner: ids only).")


class TrajectoryLog:
    """The producer's side (wants, offer, close) and the writer thread behind it."""

    def __init__(self, config: TrajectoryLogConfig | None, tokenizer: str | None = None):
        self.config = config or TrajectoryLogConfig()
        self.enabled = bool(self.config.path and self.config.every_n_groups)
        self.stride = self.config.every_n_groups
        self.tokenizer = self.config.tokenizer or tokenizer
        self.stats = {"offered": 0, "written": 0, "skipped_full": 0, "too_large": 0, "thinned": 0}
        self.size = 0  # of the file, as the writer thread knows it
        self._queue: queue.Queue = queue.Queue(self.config.queue_groups)
        self._thread: threading.Thread | None = None
        if self.enabled:
            self.path = pathlib.Path(self.config.path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._thread = threading.Thread(target=self._write_all, name="relayrl-trajectories", daemon=True)
            self._thread.start()

    def wants(self, group_index: int) -> bool:
        return self.enabled and group_index % self.stride == 0

    def offer(self, group_index: int, build: Callable[[Spell], dict]) -> None:
        """Hand a group to the writer; `build(spell)` makes its record there (the producer's objects must not
        change after this)."""
        if not self.wants(group_index):
            return
        self.stats["offered"] += 1
        try:
            self._queue.put_nowait((group_index, build))
        except queue.Full:
            self.stats["skipped_full"] += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (at most `timeout_s`), then stop the thread."""
        if self._thread is None:
            return
        try:
            self._queue.put((None, None), timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._thread = None

    # ---------------------------------------------------------------- the writer thread

    def _write_all(self) -> None:
        spell = self._speller()
        self.size = self.path.stat().st_size if self.path.exists() else 0
        while True:
            group_index, build = self._queue.get()
            if build is None:
                return
            try:
                record = build(spell)
                self._append(group_index, group_line(group_index, self.stride, record))
            except Exception:  # the log is for reading: it must never stop the producer
                log.exception("trajectory log: group %d not written", group_index)

    def _speller(self) -> Spell | None:
        """Each token's text, special tokens included. From the folder's tokenizer.json by the `tokenizers` library
        (its import takes a tenth of a second; transformers' took 9 s on a busy machine, longer than short runs)."""
        if not self.tokenizer:
            return None
        path = pathlib.Path(self.tokenizer) / "tokenizer.json"
        if path.is_file():
            from tokenizers import Tokenizer

            fast = Tokenizer.from_file(str(path))
            return lambda ids: fast.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)
        from transformers import AutoTokenizer

        slow = AutoTokenizer.from_pretrained(self.tokenizer)
        return lambda ids: slow.batch_decode([[int(i)] for i in ids])

    def _append(self, group_index: int, line: bytes) -> None:
        if group_index % self.stride:
            return  # offered before the stride widened
        if len(line) > self.config.max_bytes // 4:
            self.stats["too_large"] += 1
            return
        while self.size + len(line) > self.config.max_bytes:
            self._thin()
            if group_index % self.stride:
                return  # no longer in the sample
        with open(self.path, "ab") as out:
            out.write(line)
        self.size += len(line)
        self.stats["written"] += 1

    def _thin(self) -> None:
        """Keep every other group the file holds: the stride doubles."""
        self.stride *= 2
        self.stats["thinned"] += 1
        kept = [line for line in self.path.read_bytes().splitlines(keepends=True) if _kept(line, self.stride)]
        temporary = self.path.with_suffix(".thinning")
        temporary.write_bytes(b"".join(kept))
        os.replace(temporary, self.path)
        self.size = sum(map(len, kept))
        log.info("trajectory log: %s reached %d bytes; now every %d-th group", self.path, self.config.max_bytes,
                 self.stride)


def _kept(line: bytes, stride: int) -> bool:
    match = _INDEX.match(line)
    return match is not None and int(match.group(1)) % stride == 0


def group_line(group_index: int, stride: int, record: dict) -> bytes:
    """One group as its JSON line, its group index first (thinning reads it without parsing the line)."""
    return (json.dumps({"group_index": group_index, "stride": stride, **record}, separators=(", ", ": "),
                       default=str) + "\n").encode()


def sample_record(sample: Sample, spell: Spell | None, newest_version: int) -> dict:
    """What the viewer shows of one sample. Its staleness is the versions between its oldest token and the newest
    the trainer or the rollout had when it was stored: the staleness it trains at is at least that."""
    versions = sample.weight_versions.tolist()
    ids = sample.response_ids.tolist()
    oldest = sample.oldest_version
    return {
        "sample_id": sample.sample_id, "text": sample.response_text, "ids": ids,
        "tokens": spell(ids) if spell else None,
        "logprobs": [round(x, 4) for x in sample.rollout_logprobs.tolist()], "versions": versions,
        # a teacher's (or reference's) logprob of each token, where the driver asked one (distillation)
        "ref_logprobs": [round(x, 4) for x in sample.ref_logprobs.tolist()] if sample.ref_logprobs.size else None,
        "loss_mask": sample.loss_mask.tolist(), "reward": sample.reward, "reward_details": sample.reward_details,
        "turn_rewards": sample.turn_rewards.tolist(), "status": sample.status.name.lower(), "reason": sample.reason,
        "min_version": oldest, "max_version": max(versions, default=-1), "kv_version": sample.kv_version,
        "staleness": max(0, newest_version - oldest) if oldest >= 0 else None,
        "advantage": round(float(sample.advantages.mean()), 4) if sample.advantages.size else None,
    }


def group_record(kind: str, samples: Sequence[Sample], producer_id: str, trainer_version: int, served_version: int,
                 spell: Spell | None, time_s: float, prompt: dict | None = None, extra: Sequence[dict] = ()) -> dict:
    """A scored group (`kind` "group": the driver's completions of one prompt, whose metadata is the prompt's, and
    its images (base64) when it has some;
    "episodes": the runner's episodes of one task) as one record. `prompt` adds to or replaces the prompt's fields
    (an episode's first messages); `extra` adds fields to each sample's record (an episode's turns)."""
    first = samples[0]
    newest = max(trainer_version, served_version)
    records = [sample_record(s, spell, newest) for s in samples]
    for record, more in zip(records, extra, strict=False):
        record.update(more)
    oldest = [r["min_version"] for r in records if r["min_version"] >= 0]
    return {
        "kind": kind, "group_id": first.group_id, "prompt_id": first.prompt_id, "producer_id": producer_id,
        "time": time_s, "version": min(oldest, default=served_version), "trainer_version": trainer_version,
        "served_version": served_version,
        "prompt": {"text": first.prompt_text, "ids": first.prompt_ids.tolist(), "metadata": first.metadata,
                   **({"images": [{"media_type": image.media_type, "data": base64.b64encode(image.data).decode()}
                                  for image in first.images]} if first.images else {}),
                   **(prompt or {})},
        "samples": records,
    }
