"""The Put side of the replay buffer: validate, deduplicate, append, publish once durable.

- A Put answers after its PUT records are durable (commit.py). Its samples are handed out only once
  durable (STAGED until then), so a trainer never trains on a sample a crash could take back.
- The images its samples carry are stored once by hash, durably before their PUT records (images.py).
- An id once stored is a duplicate for the life of the data dir (buffer.py).
- A member arriving for a group that is complete, closed or done is stored and dropped at once
  ("late_member"), so it never opens a group that cannot complete. A failed sample is stored and dropped
  ("failed"): a generation error is never a silent zero-reward sample.
"""

import asyncio
import functools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

from google.protobuf.message import DecodeError

from protos import common_pb2
from protos.codec import CodecError
from protos.sample import Sample, SampleStatus
from services.buffer import metrics
from services.buffer.entries import NewSample
from services.buffer.log import RecordKind
from services.buffer.records import drop_record
from services.buffer.results import BufferFull, PutResult, StagedPut
from services.buffer.retired import sample_hashes

Payload = bytes | memoryview  # one serialized common_pb2.Sample


class Intake:
    """ReplayBuffer's Put (a part of ReplayBuffer: it works on the state ReplayBuffer.__init__ declares)."""

    async def put(self, payloads: Sequence[Payload]) -> PutResult:
        """Store serialized common_pb2.Sample messages; returns once they are durable."""
        return await self.commit_put(await self.stage_put(payloads))

    async def stage_put(self, payloads: Sequence[Payload]) -> StagedPut:
        """Validate, deduplicate and append serialized samples (stored as received, never
        re-encoded), waiting for room under back-pressure 'block'.

        Raises CodecError or GroupSizeConflict (bad input: nothing is stored) or BufferFull.
        """
        samples = [(payload, parse_sample(payload)) for payload in payloads]
        deadline = self.clock() + self.config.block_timeout_s
        while True:
            self._expire_groups()
            fresh = self._fresh(samples)
            need = sum(sample.status is not SampleStatus.FAILED for _, sample in fresh)
            if need <= self.store.free:
                return self._stage(fresh, duplicates=len(samples) - len(fresh))
            wait = deadline - self.clock()
            if need > self.store.capacity or self.config.backpressure == "reject" or wait <= 0:
                metrics.REJECTED.inc()
                raise BufferFull(
                    f"buffer full: {need} new samples, room for {self.store.free} of capacity "
                    f"{self.store.capacity}; retry after the trainer acks (the same sample ids are safe to resend)"
                )
            await self._room_freed.wait(wait)

    async def commit_put(self, staged: StagedPut) -> PutResult:
        """Wait until the staged samples are durable and pullable."""
        await asyncio.shield(self.finish_put(staged))
        return staged.result

    def finish_put(self, staged: StagedPut) -> asyncio.Future[None]:
        """Make the staged samples pullable once durable; the future completes then. Publishing
        happens even if nobody awaits the future any more (the samples are on disk either way)."""
        durable = self.durability.durable_future(staged.position)
        if durable.done():  # publish now: a done future would run its callbacks only on the next turn
            self._publish(staged, durable)
        else:  # runs before any awaiter of `durable` resumes (callbacks run in registration order)
            durable.add_done_callback(functools.partial(self._publish, staged))
        return durable

    def _publish(self, staged: StagedPut, durable: asyncio.Future[None]) -> None:
        if durable.cancelled() or durable.exception() is not None:
            return
        self.store.publish(staged.held_ids)
        if staged.held_ids:
            self._pending_changed.fire()

    def _fresh(self, samples: list[tuple[Payload, Sample]]) -> list[tuple[Payload, Sample]]:
        seen: set[str] = set()
        fresh = []
        retired = self.retired.contains(sample_hashes([sample.sample_id for _, sample in samples]))
        for (payload, sample), was_stored in zip(samples, retired.tolist()):
            sample_id = sample.sample_id
            if not was_stored and sample_id not in seen and sample_id not in self.store:
                seen.add(sample_id)
                fresh.append((payload, sample))
        return fresh

    def _stage(self, fresh: list[tuple[Payload, Sample]], duplicates: int) -> StagedPut:
        new = [index_view(sample) for _, sample in fresh]
        self.store.check_groups(new)
        late = self._late_members(new)
        # Stored, and dropped: a generation error is never a silent zero-reward sample, and a late
        # member never opens a group that cannot complete.
        drops = {
            n.sample_id: "late_member" if n.sample_id in late else "failed"
            for n, (_, s) in zip(new, fresh)
            if n.sample_id in late or s.status is SampleStatus.FAILED
        }
        payloads, refers = self._store_images(fresh, drops)
        records = [(RecordKind.PUT, payload) for payload in payloads]
        dropped = by_reason(drops)
        records += [drop_record(reason, sample_ids) for reason, sample_ids in dropped.items()]
        locations = self._append(records) if records else []
        now = self.clock()
        held = []
        for sample, location in zip(new, locations):
            reason = drops.get(sample.sample_id)
            if reason is None:
                held.append(replace(sample, ref=location))
            elif reason == "failed":  # a failed member still completes its group; a late one is no arrival
                self.store.count_arrival(sample, now)
        self.store.add(held, now)
        self.live.note_held(held)
        for sample in held:
            self.images.hold(sample.sample_id, refers.get(sample.sample_id, ()))
        self.accepted += len(new)
        self.duplicates += duplicates
        metrics.ACCEPTED.inc(len(new))
        metrics.ACCEPTED_BYTES.inc(sum(map(len, payloads)))
        metrics.DUPLICATES.inc(duplicates)
        for reason, sample_ids in dropped.items():
            self._retire(sample_ids, self.log.active_segment)
            self._count_drops(reason, len(sample_ids))
        self._compact_if_due()
        result = PutResult(accepted=len(new), duplicates=duplicates)
        return StagedPut([sample.sample_id for sample in held], self.log.appended, result)

    def _store_images(self, fresh: list[tuple[Payload, Sample]], drops: dict[str, str]
                      ) -> tuple[list[Payload], dict[str, tuple[bytes, ...]]]:
        """The samples' payloads as logged (their images' bytes moved to the image store, images.py, which holds
        them before this returns) and the hashes each refers to. CodecError names a bad image; nothing is stored
        then."""
        if not self.config.images_by_hash:
            return [payload for payload, _ in fresh], {}
        arriving: dict[bytes, bytes] = {}
        payloads, refers = [], {}
        for payload, sample in fresh:
            if sample.images:
                payload, refers[sample.sample_id] = self.images.strip(payload, f"sample {sample.sample_id!r}", arriving)
            payloads.append(payload)
        needed = {sha256 for sample_id, hashes in refers.items() if sample_id not in drops for sha256 in hashes}
        for sha256 in needed & arriving.keys():
            self.images.write(sha256, arriving[sha256])
        return payloads, refers

    def _late_members(self, samples: list[NewSample]) -> set[str]:
        """Ids of group members beyond what their group still waits for (none once it is complete,
        closed or done: see retired.py)."""
        awaited: dict[str, int] = {}
        late = set()
        for sample in samples:
            if sample.group_size <= 1:
                continue
            group_id = sample.group_id
            if group_id not in awaited:
                known = self.store.awaited(group_id)
                if known is None:
                    known = 0 if self.retired.has_group(group_id) else sample.group_size
                awaited[group_id] = known
            if awaited[group_id] > 0:
                awaited[group_id] -= 1
            else:
                late.add(sample.sample_id)
        return late


def by_reason(drops: dict[str, str]) -> dict[str, list[str]]:
    grouped: defaultdict[str, list[str]] = defaultdict(list)
    for sample_id, reason in drops.items():
        grouped[reason].append(sample_id)
    return dict(grouped)


def parse_sample(payload: Payload) -> Sample:
    """Decode and validate one serialized sample; CodecError (INVALID_ARGUMENT) names the problem."""
    try:
        msg = common_pb2.Sample.FromString(payload)
    except DecodeError as exc:
        raise CodecError(f"samples: not a valid relayrl.common.v1.Sample ({exc})") from None
    return Sample.from_proto(msg)


def index_view(sample: Sample) -> NewSample:
    return NewSample(sample.sample_id, sample.group_id, sample.group_size, sample.oldest_version)
