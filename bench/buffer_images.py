"""The replay buffer's durable bytes for a GRPO group of 8 samples sharing one image: stored once by hash
(services/buffer/images.py) against the same samples with the image inline in each record (images_by_hash: false,
the layout before the image store), each through a real buffer process.

Per layout: Put the group (each sample carrying the image's bytes, as the rollout sends them); Put failed filler
samples (dropped at once: dead bytes) until the log has rolled over and compacted; SIGKILL the buffer and restart it
on the same data dir; measure the data dir (log segments + images). Then the trainer's client pulls the group
(checked: every sample's image equal to the one put) and acks it: the image's bytes freed are printed.

    python bench/buffer_images.py [--quick] [--image-side 256] [--response-tokens 256]
"""

import argparse
import hashlib
import io
import pathlib
import re
import socket
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import grpc
import numpy as np
from PIL import Image

from deploy.local.service_process import start_service
from protos import buffer_pb2, buffer_pb2_grpc, common_pb2
from protos.sample import Sample, SampleStatus
from trainer.buffer_client import BufferClient
from trainer.config.buffer import BufferClientConfig

GROUP = 8
PROMPT_TOKENS = 64
SEGMENT_BYTES = 16 << 10


def png(side: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def sample(sample_id: str, group: str, response_tokens: int, status=SampleStatus.COMPLETED) -> common_pb2.Sample:
    rng = np.random.default_rng(abs(hash(sample_id)) % (1 << 32))
    return Sample(
        sample_id=sample_id, prompt_id=group or sample_id, group_id=group, group_size=GROUP if group else 0,
        prompt_ids=rng.integers(0, 150_000, PROMPT_TOKENS, dtype=np.int32),
        response_ids=rng.integers(0, 150_000, response_tokens, dtype=np.int32),
        loss_mask=np.ones(response_tokens, dtype=np.uint8),
        rollout_logprobs=rng.normal(-1, 0.5, response_tokens).astype(np.float32),
        weight_versions=np.zeros(response_tokens, dtype=np.int64), reward=1.0, status=status,
    ).to_proto()


def group_samples(image: bytes, response_tokens: int) -> list[common_pb2.Sample]:
    samples = []
    for i in range(GROUP):
        msg = sample(f"g-{i}", "g", response_tokens)
        msg.images.append(common_pb2.ImageRef(sha256=hashlib.sha256(image).digest(), media_type="image/png",
                                              grid_thw=[1, 16, 16], num_tokens=64, data=image))
        samples.append(msg)
    return samples


def dir_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run(by_hash: bool, image: bytes, response_tokens: int, work: pathlib.Path) -> dict:
    name = "by_hash" if by_hash else "inline"
    data_dir, address = work / name, f"127.0.0.1:{free_port()}"
    overrides = {"data_dir": str(data_dir), "server.address": address, "segment_bytes": SEGMENT_BYTES,
                 "fsync": "batch", "images_by_hash": by_hash}
    buffer = start_service("buffer", overrides, log_dir=work / f"{name}-logs", timeout=60)
    try:
        with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            put = group_samples(image, response_tokens)
            put_bytes = sum(s.ByteSize() for s in put)
            stub.Put(buffer_pb2.PutRequest(samples=put), timeout=30)
            for i in range(4 * SEGMENT_BYTES // 512):  # ~4 segments of dead bytes: the log rolls and compacts
                stub.Put(buffer_pb2.PutRequest(samples=[sample(f"f{i}", "", 16, SampleStatus.FAILED)]), timeout=30)
        compactions = len(re.findall("compacted log segments", buffer.log_path.read_text()))
        buffer.restart(60)  # SIGKILL, then the same data dir and port
        durable = dir_bytes(data_dir)
        images_before = dir_bytes(data_dir / "images") if (data_dir / "images").exists() else 0
        client = BufferClient(BufferClientConfig(address=address, max_wait_s=30))
        batch = client.pull(GROUP)
        assert len(batch.samples) == GROUP and all(s.images[0].data == image for s in batch.samples), name
        client.ack(batch.lease_id)
        deadline = time.monotonic() + 10
        while (data_dir / "images").exists() and any((data_dir / "images").iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        images_after = dir_bytes(data_dir / "images") if (data_dir / "images").exists() else 0
        return {"put_bytes": put_bytes, "durable": durable, "compactions": compactions,
                "images_before": images_before, "freed": images_before - images_after, "after_ack": dir_bytes(data_dir)}
    finally:
        buffer.stop(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the same run (it takes seconds)")
    parser.add_argument("--image-side", type=int, default=256, help="the image's side in pixels (a noise PNG)")
    parser.add_argument("--response-tokens", type=int, default=256)
    args = parser.parse_args()
    image = png(args.image_side)
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        results = {by_hash: run(by_hash, image, args.response_tokens, work) for by_hash in (True, False)}
    print(f"group of {GROUP} samples ({PROMPT_TOKENS} prompt + {args.response_tokens} response tokens) sharing one "
          f"{args.image_side}x{args.image_side} PNG of {len(image)} bytes; segments of {SEGMENT_BYTES} bytes")
    print(f"{'layout':<10}{'put bytes':>12}{'compactions':>13}{'durable bytes':>15}{'image files':>13}"
          f"{'freed on ack':>14}{'after ack':>11}")
    for by_hash, r in results.items():
        print(f"{'by hash' if by_hash else 'inline':<10}{r['put_bytes']:>12}{r['compactions']:>13}{r['durable']:>15}"
              f"{r['images_before']:>13}{r['freed']:>14}{r['after_ack']:>11}")
    ratio = results[True]["durable"] / results[False]["durable"]
    print(f"result: buffer_image_bytes_vs_inline = {ratio:.3f} (baseline the same samples with the image inline, "
          f"after compaction and a SIGKILL restart, target <= 0.2)")
    print(f"result: buffer_image_bytes_freed_after_ack = {results[True]['freed']} (the image's {len(image)} bytes; "
          f"inline: the records go with compaction)")


if __name__ == "__main__":
    main()
