"""Images in the replay buffer, stored once by hash (services/buffer/images.py): a GRPO group of 8 samples sharing one
image keeps one copy on disk, through compaction and a SIGKILL of the buffer process; the trainer's pull gets the
image back equal; the copy is deleted once the group is acked; bad image refs are refused and store nothing."""

import asyncio
import hashlib
import io
import re
import time

import grpc
import numpy as np
import pytest
from buffer_kit import config, opened
from buffer_samples import sample_proto
from PIL import Image

from deploy.local.service_process import start_service
from protos import buffer_pb2, buffer_pb2_grpc, common_pb2
from protos.codec import CodecError
from protos.sample import SampleStatus
from services.buffer.entries import PullSpec
from trainer.buffer_client import BufferClient
from trainer.config.buffer import BufferClientConfig

GROUP = 8


def png(seed: int, side: int = 96) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def image_sample(sample_id: str, group: str, data: bytes, with_bytes: bool = True, sha256: bytes | None = None,
                 status: SampleStatus = SampleStatus.COMPLETED) -> common_pb2.Sample:
    """A sample as the rollout sends it: its prompt's image with the bytes (or only the ref)."""
    msg = sample_proto(sample_id, group, GROUP if group else 0, status=status)
    msg.images.append(common_pb2.ImageRef(sha256=hashlib.sha256(data).digest() if sha256 is None else sha256,
                                          media_type="image/png", grid_thw=[1, 4, 6], num_tokens=6,
                                          data=data if with_bytes else b""))
    return msg


def group_of(name: str, data: bytes) -> list[common_pb2.Sample]:
    return [image_sample(f"{name}-{i}", name, data) for i in range(GROUP)]


def image_files(data_dir) -> list:
    return sorted((data_dir / "images").iterdir())


async def test_bad_image_refs_are_refused_and_store_nothing(tmp_path):
    buffer = await opened(config(tmp_path))
    image = png(1)
    bad = {
        "images[0].sha256: does not match": image_sample("a", "", image, sha256=b"\0" * 32),
        "images[0]: no bytes, and the buffer holds no image": image_sample("b", "", image, with_bytes=False),
    }
    for message, sample in bad.items():
        with pytest.raises(CodecError, match=re.escape(message)):
            await buffer.put([image_sample("ok", "", png(9)).SerializeToString(), sample.SerializeToString()])
        assert len(buffer.store) == 0 and image_files(tmp_path) == []
    # once the buffer holds the image (or the same put brings it), a sample may carry its ref alone
    await buffer.put([image_sample("ok", "", image).SerializeToString()])
    await buffer.put([image_sample("b", "", image, with_bytes=False).SerializeToString()])
    lease = await buffer.lease_batch(PullSpec(batch_size=2))
    for payload in lease.payloads:
        assert common_pb2.Sample.FromString(payload).images[0].data == image
    await buffer.close()


async def test_images_of_dropped_samples_are_freed_and_a_restart_deletes_what_nobody_holds(tmp_path):
    cfg = config(tmp_path, max_staleness=0)
    buffer = await opened(cfg)
    kept, dropped = png(2), png(3)
    await buffer.put([s.SerializeToString() for s in group_of("kept", kept)])
    await buffer.put([s.SerializeToString() for s in group_of("gone", dropped)])
    # a failed sample's image is never stored: it is dropped at once
    await buffer.put([image_sample("failed", "", png(4), status=SampleStatus.FAILED).SerializeToString()])
    assert len(image_files(tmp_path)) == 2
    await buffer.set_version(1)  # both groups go stale (versions 0): their images go once the DROP is durable
    await asyncio.sleep(0)
    assert image_files(tmp_path) == [] and buffer.images.freed_bytes == len(kept) + len(dropped)
    await buffer.close()

    buffer = await opened(cfg)  # an image no held sample refers to (a deletion a crash cut off) goes at open
    (tmp_path / "images" / hashlib.sha256(kept).hexdigest()).write_bytes(kept)
    await buffer.close()
    buffer = await opened(cfg)
    assert image_files(tmp_path) == [] and buffer.images.freed_bytes == len(kept)
    await buffer.close()


async def test_an_image_outlives_its_last_sample_until_the_ack_is_durable(tmp_path):
    """Deleted before the ACK is on disk, a crash would bring the group back without its image."""
    buffer = await opened(config(tmp_path, fsync="batch", fsync_window_ms=300))
    await buffer.put([s.SerializeToString() for s in group_of("g", png(8))])
    lease = await buffer.lease_batch(PullSpec(batch_size=GROUP))
    acking = asyncio.ensure_future(buffer.ack(lease.lease_id))
    await asyncio.sleep(0.05)  # the ACK is appended; its fsync waits out the group-commit window
    assert not acking.done() and len(image_files(tmp_path)) == 1
    await acking
    await asyncio.sleep(0)
    assert image_files(tmp_path) == []
    await buffer.close()


def durable_bytes(data_dir) -> int:
    return sum(p.stat().st_size for p in data_dir.rglob("*") if p.is_file())


def test_a_group_sharing_an_image_is_stored_once_through_compaction_and_a_sigkill(tmp_path, free_port):
    address = f"127.0.0.1:{free_port}"
    data_dir = tmp_path / "data"
    overrides = {"data_dir": str(data_dir), "server.address": address, "segment_bytes": 4096, "fsync": "batch"}
    buffer = start_service("buffer", overrides, log_dir=tmp_path / "logs", timeout=60)
    image = png(5, side=128)
    try:
        with grpc.insecure_channel(address) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            with pytest.raises(grpc.RpcError) as refused:  # a ref to an image the buffer does not hold
                stub.Put(buffer_pb2.PutRequest(samples=[image_sample("x", "", image, with_bytes=False)]), timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "sample 'x'.images[0]: no bytes" in refused.value.details()
            assert stub.Put(buffer_pb2.PutRequest(samples=group_of("g", image)), timeout=10).accepted == GROUP
            [stored] = image_files(data_dir)
            assert stored.read_bytes() == image and stored.name == hashlib.sha256(image).hexdigest()
            filler = 0  # failed samples, dropped at once: they roll the log until the group's segment is compacted
            while (data_dir / "0000000001.seg").exists():
                stub.Put(buffer_pb2.PutRequest(samples=[sample_proto(f"f{filler}", status=SampleStatus.FAILED)]),
                         timeout=10)
                filler += 1
        assert re.search(r"copied 8 held samples", buffer.log_path.read_text())
        buffer.restart(60)  # SIGKILL, then the same data dir and port
        assert [p.read_bytes() for p in image_files(data_dir)] == [image]
        assert durable_bytes(data_dir) < 2 * len(image)  # 8 samples inline would be over 8 images' worth

        client = BufferClient(BufferClientConfig(address=address, max_wait_s=30))
        batch = client.pull(GROUP)
        assert sorted(s.sample_id for s in batch.samples) == [f"g-{i}" for i in range(GROUP)]
        for sample in batch.samples:
            [ref] = sample.images
            assert (ref.data, ref.sha256, ref.media_type, ref.grid_thw, ref.num_tokens) == (
                image, hashlib.sha256(image).digest(), "image/png", (1, 4, 6), 6)
        assert client.ack(batch.lease_id) == GROUP
        deadline = time.monotonic() + 10
        while image_files(data_dir) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert image_files(data_dir) == []
        buffer.restart(60)  # acked for good: the group does not come back, its image neither
        assert image_files(data_dir) == []
        with grpc.insecure_channel(address) as channel:
            stats = buffer_pb2_grpc.BufferStub(channel).Stats(buffer_pb2.StatsRequest(), timeout=10)
        assert (stats.acked, stats.pending, stats.leased) == (GROUP, 0, 0)
    finally:
        buffer.stop(timeout=10)
