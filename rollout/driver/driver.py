"""The rollout driver: turns a prompt dataset into scored groups of samples in the replay buffer.

    for each prompt: Generate n completions (rollout) -> Score them (reward) -> Put the group (buffer)

How far generation may run ahead of training is decided in one place, `_admit`: a group starts only
while the version it will train at (from what the buffer holds, what the trainer consumes and what is
in flight; rollout/driver/admission.py) lags the version generating it by at most max_staleness.
max_staleness = 0 is synchronous (on-policy) RL.

Every group and sample id carries a producer id (fresh at each start unless configured), so a restarted
driver never reuses an id the buffer holds; with position_path it also goes on where the last one stopped; samples the buffer already stored come back as duplicates,
counted in the stats and logged.
"""

import asyncio
import base64
import binascii
import json
import logging
import pathlib
import sys
import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field

from protos import buffer_pb2, buffer_pb2_grpc, reward_pb2, reward_pb2_grpc, rollout_pb2, rollout_pb2_grpc
from protos.codec import decode_array, decode_tensor, encode_array
from protos.sample import ROUTE_DTYPES, Sample, SampleImage, SampleStatus
from rollout.driver.call_merger import CallMerger
from rollout.driver.producer import GroupProducer, run_producer
from rollout.driver.trajectory_log import TrajectoryLogConfig
from services.client import connect
from services.config import ClientConfig, Strict, TracingConfig
from services.tracing import TRACEPARENT, current_traceparent, span

log = logging.getLogger("relayrl.driver")

_STATUS = {
    rollout_pb2.FINISH_REASON_STOP: SampleStatus.COMPLETED,
    rollout_pb2.FINISH_REASON_LENGTH: SampleStatus.TRUNCATED,
    rollout_pb2.FINISH_REASON_ABORT: SampleStatus.ABORTED,
}


class DriverConfig(Strict):
    """Where the services are and how to sample."""

    rollout: str = Field(description="Rollout service address host:port.")
    reward: str = Field(description="Reward service address, or a gRPC target naming its replicas "
                        "(ipv4:HOST:PORT,HOST:PORT): Score calls go round-robin to those that answer.")
    buffer: str = Field(description="Replay buffer address.")
    clients: dict[Literal["rollout", "reward", "buffer"], ClientConfig] = Field(
        default_factory=dict, description="How to reach each service when it has TLS or tokens on (ca_cert, token).")
    teacher: str | None = Field(
        None, description="Rollout service of a teacher (or reference) model: its logprobs of every sampled token "
        "become the samples' ref_logprobs (on-policy distillation, a KL term to a served reference). With "
        "`teachers`, the teacher of every domain not listed there.")
    teachers: dict[str, str] = Field(
        default_factory=dict, description="Multi-teacher on-policy distillation (MOPD): {domain: rollout address}; "
        "a prompt's domain is its metadata[teacher_key], and its samples' ref_logprobs come from that domain's "
        "teacher (or `teacher` when the domain is not listed). A prompt with no teacher fails at load.")
    teacher_key: str = Field("domain", description="The prompt metadata field naming its domain (teachers).")
    prompts: str = Field(description="JSONL prompt dataset: {prompt_id, prompt, metadata[, images]} per line "
                         "(images: base64 encoded images, one per image placeholder in the prompt; docs/multimodal.md).")
    tokenizer: str = Field(description="Folder of the tokenizer that makes prompt token ids.")
    add_bos: bool = Field(True, description="Prepend the tokenizer's bos token to every prompt.")
    group_size: int = Field(8, ge=1, description="Completions per prompt (the GRPO group).")
    groups_per_batch: int = Field(8, ge=1, description="Groups in one training batch.")
    max_staleness: int = Field(1, ge=0, description="Versions a sample may lag the trainer; 0 = on-policy.")
    versions_per_batch: int = Field(
        1, ge=1, description="Weight versions the trainer advances per batch it takes (its batch.mini_batches).")
    admission_poll_s: float = Field(
        0.025, gt=0, description="Poll buffer Stats and the rollout's GetWeightVersion at most this often.")
    producer_id: str | None = Field(
        None, description="Goes into every group and sample id; None = a fresh random token at each start, so "
        "a restarted driver never reuses an id (the buffer would drop its new samples as duplicates).")
    position_path: str | None = Field(
        None, description="Keep the driver's place in the prompt stream here (rollout/driver/position.py): a driver started "
        "again goes on from it, neither repeating nor skipping a group, under a producer id none before it had.")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: int = Field(8, gt=0)
    concurrency: int = Field(8, ge=1, description="Prompts in flight at once.")
    reward_function: str = Field("exact_match", description="Reward function name on the reward service.")
    reward_timeout_s: float = Field(10.0, gt=0)
    max_groups: int = Field(0, ge=0, description="Stop after this many groups (0 = run until stopped).")
    seed: int = 0
    stats_path: str | None = Field(None, description="Append a JSON line of driver stats here every few seconds.")
    rpc_timeout_s: float = Field(120.0, gt=0, description="Deadline of each rollout/reward/buffer call.")
    merge_window_s: float = Field(
        0.002, ge=0, description="Generate, Score and Put calls of groups made within this window travel as one "
        "request (GenerateMany; at most groups_per_batch groups): fewer round trips for driver, rollout, reward and "
        "buffer. 0 = one per group.")
    trajectory_log: TrajectoryLogConfig = Field(
        default_factory=TrajectoryLogConfig, description="A sample of the scored groups kept for `relayrl view` "
        "(rollout/driver/trajectory_log.py); off without a path.")
    deterministic: bool = Field(
        False, description="A deterministic run (deploy/experiment/schema.py): the groups admitted together (with "
        "max_staleness 0, one training step's) go to the rollout as one GenerateMany, in stream order, whatever the "
        "timing, so the rollout batches and computes them the same way in every run (merge_window_s is not used "
        "for them).")
    tracing: TracingConfig = Field(default_factory=TracingConfig, description="Tracing of the groups admitted "
                                   "(services/tracing.py): their root spans, and the trace context in each sample.")


@dataclass
class Prompt:
    prompt_id: str
    text: str
    ids: list[int]
    metadata: dict
    images: list[bytes] = field(default_factory=list)  # encoded images, one per image placeholder (docs/multimodal.md)


def load_prompts(config: DriverConfig) -> list[Prompt]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
    prompts = []
    for line in pathlib.Path(config.prompts).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        ids = tokenizer.encode(row["prompt"], add_special_tokens=False)
        if config.add_bos and tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id, *ids]
        prompts.append(Prompt(str(row["prompt_id"]), row["prompt"], ids, row.get("metadata", {}),
                              _decoded_images(row, config.prompts)))
    if not prompts:
        raise ValueError(f"{config.prompts}: no prompts")
    if config.teachers and not config.teacher:
        untaught = {p.prompt_id: p.metadata.get(config.teacher_key) for p in prompts
                    if p.metadata.get(config.teacher_key) not in config.teachers}
        if untaught:
            prompt_id, domain = next(iter(untaught.items()))
            raise ValueError(f"{config.prompts}: {len(untaught)} prompts have no teacher (e.g. {prompt_id!r}, "
                             f"metadata {config.teacher_key}={domain!r}; teachers: {sorted(config.teachers)}); "
                             "list their domain in teachers or set teacher as the default")
    return prompts


def _decoded_images(row: dict, where: str) -> list[bytes]:
    """A prompt row's `images` (base64 strings of encoded images), decoded; ValueError names the row."""
    try:
        return [base64.b64decode(image, validate=True) for image in row.get("images", [])]
    except (binascii.Error, TypeError) as exc:
        raise ValueError(f"{where}: prompt {row['prompt_id']!r}: images must be base64 strings ({exc})") from None


class Driver(GroupProducer):
    def __init__(self, config: DriverConfig):
        channels = [connect(getattr(config, name), config.clients.get(name)) for name in ("rollout", "reward", "buffer")]
        self.rollout = rollout_pb2_grpc.RolloutStub(channels[0])
        self.reward = reward_pb2_grpc.RewardStub(channels[1])
        self.buffer = buffer_pb2_grpc.BufferStub(channels[2])
        # One channel per teacher address; the domain None is the default teacher (config.teacher).
        stubs: dict[str, rollout_pb2_grpc.RolloutStub] = {}
        for address in {config.teacher, *config.teachers.values()} - {None}:
            channels.append(connect(address))
            stubs[address] = rollout_pb2_grpc.RolloutStub(channels[-1])
        self.teachers = {domain: stubs[address] for domain, address in config.teachers.items()}
        self.default_teacher = stubs[config.teacher] if config.teacher else None
        super().__init__(config, channels, tokenizer=config.tokenizer)
        batch_samples = config.groups_per_batch * config.group_size
        self.generator = CallMerger(self._generate, None if config.deterministic else config.merge_window_s,
                                    config.groups_per_batch)
        self.scorer = CallMerger(self._score, config.merge_window_s, batch_samples)
        self.storer = CallMerger(self._put, config.merge_window_s, batch_samples)
        self.stats = {"groups": 0, "samples": 0, "tokens": 0, "reward_sum": 0.0, "failed": 0, "retries": 0,
                      "accepted": 0, "duplicates": 0}

    async def _generate(self, requests: list) -> list:
        reply = await self._call(self.rollout.GenerateMany, rollout_pb2.GenerateManyRequest(requests=requests),
                                 "GenerateMany")
        return list(reply.responses)

    async def _score(self, protos: list) -> list:
        cfg = self.config
        reply = await self._call(self.reward.Score, reward_pb2.ScoreRequest(
            samples=protos, function=cfg.reward_function, timeout_s=cfg.reward_timeout_s), "Score")
        return list(reply.results)

    async def _put(self, protos: list) -> list:
        reply = await self._call(self.buffer.Put, buffer_pb2.PutRequest(samples=protos), "Put")
        self.stats["accepted"] += reply.accepted
        self.stats["duplicates"] += reply.duplicates
        if reply.duplicates:
            log.warning("the buffer already held %d of %d samples put (a retried Put it had stored, or an id "
                        "reused by another producer); %d duplicates so far", reply.duplicates, len(protos),
                        self.stats["duplicates"])
        return [None] * len(protos)

    async def before_wait(self) -> None:
        """A deterministic run: the groups started since the last wait go to the rollout now, as one request."""
        if self.config.deterministic:
            await asyncio.sleep(0)  # each group's task (started in stream order) reaches the generator first
            self.generator.flush()

    async def run_group(self, prompt: Prompt, group_index: int) -> None:
        cfg = self.config
        group_id = f"{prompt.prompt_id}#{self.producer_id}.{group_index}"
        request = rollout_pb2.GenerateRequest(
            request_id=group_id,
            prompt_ids=encode_array(prompt.ids, "int32"),
            params=rollout_pb2.SamplingParams(
                temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens,
                n=cfg.group_size, logprobs=True, seed=(cfg.seed * 1_000_003 + group_index) % 2**63,
            ),
            images=[rollout_pb2.ImagePart(data=data) for data in prompt.images],
        )
        with span("driver.generate"):  # each traced group's wait; merged calls' server spans join one group's
            (reply,) = await self.generator.submit([request])
        traceparent = current_traceparent()  # a traced group's samples carry it through the buffer to the trainer
        metadata = prompt.metadata if traceparent is None else {**prompt.metadata, TRACEPARENT: traceparent}
        # with images: the prompt as the rollout expanded it, and each image as it saw it (the trainer's inputs)
        prompt_ids = decode_array(reply.prompt_ids, "prompt_ids", "int32") if reply.images else prompt.ids
        images = [SampleImage(ref.sha256, ref.media_type, tuple(ref.grid_thw), ref.num_tokens, data)
                  for ref, data in zip(reply.images, prompt.images, strict=True)]
        samples = []
        for completion in reply.completions:
            tokens = decode_array(completion.token_ids, "token_ids", "int32")
            versions = decode_array(completion.weight_versions, "weight_versions", "int64")
            samples.append(Sample(
                sample_id=f"{group_id}/{completion.index}",
                prompt_id=prompt.prompt_id,
                group_id=group_id,
                group_size=cfg.group_size,
                prompt_ids=np.asarray(prompt_ids, np.int32),
                response_ids=tokens,
                loss_mask=np.ones(tokens.size, np.uint8),
                rollout_logprobs=decode_array(completion.logprobs, "logprobs", "float32"),
                weight_versions=versions,
                temperature=completion.logprobs_temperature,
                kv_version=completion.kv_version if completion.HasField("kv_version") else None,
                routed_experts=decode_tensor(completion.routed_experts, "routed_experts", ROUTE_DTYPES, 3),
                status=_STATUS.get(completion.finish_reason, SampleStatus.FAILED),
                reason=rollout_pb2.FinishReason.Name(completion.finish_reason),
                prompt_text=prompt.text,
                response_text=completion.text,
                metadata=metadata,
                images=images,
            ))
        protos = [s.to_proto() for s in samples]  # encoded once: scored, then completed and stored
        scoring = self.scorer.submit(protos)
        teacher = self.teacher_for(prompt)
        if teacher is None:
            with span("driver.score"):
                scored = await scoring
        else:
            taught = self._add_teacher_logprobs(teacher, request.prompt_ids, reply, samples, protos)
            scored, _ = await asyncio.gather(scoring, taught)
        for sample, proto, result in zip(samples, protos, scored, strict=True):
            sample.reward = proto.reward = result.reward
            sample.reward_details = dict(result.details)
            proto.reward_details.update(result.details)
            if result.status == SampleStatus.FAILED:
                sample.status, sample.reason = SampleStatus.FAILED, f"reward: {result.reason}"
                proto.status, proto.reason = int(sample.status), sample.reason
                self.stats["failed"] += 1
        with span("driver.put"):
            await self.storer.submit(protos)
        self.log_group("group", group_index, lambda: samples)
        self.stats["groups"] += 1
        self.stats["samples"] += len(samples)
        self.stats["tokens"] += sum(s.response_ids.size for s in samples)
        self.stats["reward_sum"] += sum(s.reward for s in samples)

    def teacher_for(self, prompt: Prompt) -> rollout_pb2_grpc.RolloutStub | None:
        """The teacher of the prompt's domain (MOPD), else the default teacher, else None (no distillation)."""
        domain = prompt.metadata.get(self.config.teacher_key)
        return self.teachers.get(domain, self.default_teacher) if isinstance(domain, str) else self.default_teacher

    async def _add_teacher_logprobs(self, stub, prompt_ids, reply, samples: list[Sample], protos: list) -> None:
        """The teacher's logprob of every sampled token, as the samples' ref_logprobs: the protos stored and the
        samples the trajectory log keeps."""
        teacher = await self._call(stub.ComputeLogprobs, rollout_pb2.ComputeLogprobsRequest(
            prompt_ids=prompt_ids, response_ids=[c.token_ids for c in reply.completions],
            temperature=self.config.temperature or 1.0,
            images=[rollout_pb2.ImagePart(data=image.data) for image in samples[0].images]), "ComputeLogprobs")
        for sample, proto, logprobs in zip(samples, protos, teacher.logprobs, strict=True):
            # a malformed reply fails here, not in the buffer
            sample.ref_logprobs = decode_array(logprobs, "ref_logprobs", "float32")
            proto.ref_logprobs.CopyFrom(logprobs)

    def snapshot(self) -> dict:
        elapsed = time.monotonic() - self.started_at
        s = self.stats
        return {
            "time": time.time(), "elapsed_s": elapsed, "producer_id": self.producer_id, "version": self.version,
            **s, "admission_polls": self.gauge.polls, "version_wakeups": self.gauge.wakeups,
            "idle_s": self.idle_s,
            "completions_per_s": s["samples"] / elapsed if elapsed else 0.0,
            "tokens_per_s": s["tokens"] / elapsed if elapsed else 0.0,
            "mean_reward": s["reward_sum"] / s["samples"] if s["samples"] else 0.0,
            "trajectory_log": self.trajectories.stats,
        }

async def drive(config: DriverConfig) -> dict:
    prompts = load_prompts(config)
    return await Driver(config).run_to_end(prompts)


def main(argv: list[str] | None = None) -> int:
    return run_producer("driver", "Feed the replay buffer with scored groups of completions.", DriverConfig, drive, argv)


if __name__ == "__main__":
    sys.exit(main())
