"""A sharded policy published bucket by bucket (trainer/broadcast/gather.py): each tensor gathered on the trainer's
device straight into its slot of the bucket being sent, instead of a full state dict gathered to host memory first.

On CPU the gather path is the same code on CPU tensors. One process: whole tensors fill buckets byte for byte as
packing does. Two ranks under torchrun (FSDP2 over gloo; the test runs this file as the script): the bytes of every
bucket equal the old path's (get_model_state_dict to host, then packing), as float32 and cast to bfloat16; rank 0's
peak of extra memory (the storages its ops create, counted until freed) is about a bucket, not the model; a publish
that fails half way leaves the ranks in step; and a real publish to a rollout engine lands bit-exact.
"""

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from services.weights import BucketSender, Transfer, TransferError, pack_bucket
from services.weights.transfer import Pending
from trainer.broadcast.config import BroadcastConfig
from trainer.broadcast.gather import ShardedWeights
from trainer.broadcast.plan import BroadcastPlan

ROOT = Path(__file__).resolve().parents[1]
BUCKET_MB = 0.25  # the largest tensor of the test model (an MLP matrix, 512 x 128 float32) travels alone


class _Done(Pending):
    def wait(self, deadline: float) -> None:
        return None


class RecordingTransfer(Transfer):
    """Rank 0 of no group: records a digest of every bucket it is asked to broadcast (hashlib reads the
    tensor's memory in place, so recording allocates nothing through torch); `fail_at` raises there."""

    def __init__(self, fail_at: int | None = None):
        self.digests: list[str] = []
        self.fail_at = fail_at

    def broadcast(self, tensor: torch.Tensor) -> Pending:
        if len(self.digests) == self.fail_at:
            raise TransferError("the wire broke")
        self.digests.append(hashlib.sha256(memoryview(tensor.numpy())).hexdigest())
        return _Done()

    def _release(self) -> None:
        return None


def send(manifest, tensors, fail_at: int | None = None) -> list[str]:
    transfer = RecordingTransfer(fail_at)
    BucketSender().send(transfer, manifest, tensors, deadline=float("inf"))
    return transfer.digests


def packed_digests(manifest, tensors) -> list[str]:
    return [hashlib.sha256(memoryview(pack_bucket(manifest, i, tensors).numpy())).hexdigest()
            for i in range(len(manifest.bucket_sizes))]


class LiveBytes(TorchDispatchMode):
    """The peak of bytes held at once by the storages that ops create while it is active, each counted from the op
    that made it until it is freed (a DTensor's by its local shard). What a backend allocates inside a collective
    and frees before returning (gloo's flat all-gather buffer) is not seen: NCCL gathers in place."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {storage.data_ptr() for storage in _storages((args, kwargs))}
        for storage in _storages(out):
            if storage.nbytes() and storage.data_ptr() not in inputs and id(storage) not in self._counted:
                self._count(storage)
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key, nbytes = id(storage), storage.nbytes()
        self._counted.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)  # fires when the storage itself is released

    def _free(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live -= nbytes


def _storages(tree) -> list[torch.UntypedStorage]:
    """The storages of the tensors in `tree`; a wrapper tensor's (a DTensor, an async collective's) are its inner ones."""
    found = []
    for tensor in tree_leaves(tree):
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            found += _storages([getattr(tensor, name) for name in names])
        elif isinstance(tensor, torch.Tensor):
            found.append(tensor.untyped_storage())
    return found


def peak_extra_bytes(fn):
    """fn()'s result and the peak of memory its tensors held at once (LiveBytes)."""
    with LiveBytes() as live:
        result = fn()
    return result, live.peak


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {"model.embed_tokens.weight": torch.randn(101, 64, generator=gen),
            "model.layers.0.self_attn.k_proj.weight": torch.randn(16, 64, generator=gen),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=gen).t(),  # not contiguous
            "model.layers.0.self_attn.q_proj.bias": torch.randn(64, generator=gen),
            "model.norm.weight": torch.randn(64, generator=gen).to(torch.bfloat16),
            "lm_head.weight": torch.randn(101, 64, generator=gen)}


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_whole_tensors_fill_each_bucket_as_packing_does(dtype):
    """A world of one: the same code on whole tensors writes the bytes packing writes, cast as configured."""
    weights = _weights()
    plan = BroadcastPlan(BroadcastConfig(bucket_mb=0.01, dtype=dtype))
    prepared = plan.prepare(weights)
    manifest = plan.manifest(prepared)
    assert len(manifest.bucket_sizes) > 2
    source = ShardedWeights(weights, "cpu", None if dtype is None else torch.bfloat16)
    assert plan.manifest(source) == manifest
    assert send(manifest, source) == packed_digests(manifest, prepared)
    assert source.gathered == len(manifest.slots)


def test_gathering_twice_or_out_of_order_is_refused():
    weights = _weights()
    plan = BroadcastPlan(BroadcastConfig(bucket_mb=0.01))
    source = ShardedWeights(weights, "cpu")
    manifest = plan.manifest(source)
    source.finish()
    with pytest.raises(TransferError, match="out of order"):
        send(manifest, source)
    with pytest.raises(ValueError, match="every rank must gather the bytes that are sent"):
        BroadcastPlan(BroadcastConfig(dtype="bfloat16")).prepare(ShardedWeights(weights, "cpu"))


def test_a_tied_tensor_is_gathered_once():
    weights = _weights()
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    names = [name for name, _, _ in ShardedWeights(weights, "cpu").layout()]
    assert "lm_head.weight" not in names and len(names) == len(weights) - 1


# -- two ranks under torchrun ---------------------------------------------------------------------------------------

def worker(model_dir: str, out: str) -> None:
    """Each rank: the policy sharded by FSDP2; rank 0 publishes it by each path and writes what it measured."""
    torch.set_num_threads(1)
    from trainer.checkpoint import hf_state_dict, ties_embeddings
    from trainer.model import load_policy
    from trainer.parallel import gather_model_state, init_distributed, parallelize, shutdown_distributed

    env = init_distributed("cpu")
    policy = load_policy(model_dir)
    with torch.no_grad():  # weights that differ from the folder's, the same on every rank
        gen = torch.Generator().manual_seed(5)
        for param in policy.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    policy = parallelize(policy, env)
    tied = ties_embeddings(policy)
    results: dict = {}

    def sharded(dtype=None) -> ShardedWeights:
        return ShardedWeights(hf_state_dict(policy.state_dict(), tied), env.device, dtype)

    for dtype in (None, "bfloat16"):
        plan = BroadcastPlan(BroadcastConfig(bucket_mb=BUCKET_MB, dtype=dtype))
        cast = None if dtype is None else torch.bfloat16

        def old_path(plan=plan):  # every rank takes part in the gather; rank 0 holds the result
            full = hf_state_dict(gather_model_state(policy, env), tied)
            if not env.is_main:
                return None
            prepared = plan.prepare(full)
            manifest = plan.manifest(prepared)
            return manifest, send(manifest, prepared)

        def new_path(plan=plan, cast=cast):
            source = sharded(cast)
            if not env.is_main:
                return source.finish()
            manifest = plan.manifest(source)
            digests = send(manifest, source)
            source.finish()
            return manifest, digests

        (old, old_peak), (new, new_peak) = peak_extra_bytes(old_path), peak_extra_bytes(new_path)
        if env.is_main:
            assert old[0] == new[0], "the same manifest"
            results[str(dtype)] = {"old": old[1], "new": new[1], "old_peak": old_peak, "new_peak": new_peak,
                                   "total": old[0].total_bytes, "buckets": len(old[0].bucket_sizes),
                                   "largest_bucket": max(old[0].bucket_sizes)}

    # A publish whose transfer fails at the third bucket: finish() gathers the rest, and the ranks stay in step.
    plan = BroadcastPlan(BroadcastConfig(bucket_mb=BUCKET_MB))
    source = sharded()
    if env.is_main:
        with pytest.raises(TransferError, match="the wire broke"):
            send(plan.manifest(source), source, fail_at=2)
    source.finish()
    again = sharded()
    if env.is_main:
        results["after_failure"] = send(plan.manifest(again), again)
    again.finish()

    reference = hf_state_dict(gather_model_state(policy, env), tied)  # what the old path sends (collective)
    if env.is_main:
        results["published"] = publish_to_engine(model_dir, sharded(), reference)
    else:
        sharded().finish()
    if env.is_main:
        Path(out).write_text(json.dumps(results))
    shutdown_distributed(env)


def publish_to_engine(model_dir: str, source: ShardedWeights, reference: dict[str, torch.Tensor]) -> dict:
    """Rank 0: a real WeightBroadcaster publish of `source` to a native engine served in this process; the names of
    the tensors the engine serves afterwards that differ from `reference`."""
    from protos import weights_pb2_grpc
    from rollout.config import EngineConfig
    from rollout.engine.async_engine import AsyncEngine
    from rollout.engine.llm_engine import LLMEngine
    from rollout.serve.weight_receiver import WeightReceiver
    from services.server import create_server
    from trainer.broadcast.broadcaster import WeightBroadcaster

    async def main():
        engine = AsyncEngine(LLMEngine(EngineConfig(model=model_dir, num_blocks=32, max_num_seqs=2, max_n=1)))
        registration = (weights_pb2_grpc.add_WeightSyncServicer_to_server, WeightReceiver(engine),
                        "relayrl.weights.v1.WeightSync")
        server, port = await create_server("127.0.0.1:0", [registration])
        await server.start()
        try:
            config = BroadcastConfig(bucket_mb=BUCKET_MB, timeout_s=60)
            async with WeightBroadcaster([f"127.0.0.1:{port}"], config) as broadcaster:
                report = await broadcaster.publish(source, 1)
            await asyncio.to_thread(source.finish)
            return report, dict(engine.engine.runner.model.named_parameters())
        finally:
            await server.stop(1)
            engine.shutdown()

    report, served = asyncio.run(main())
    return {"ok": report.ok, "failed": report.failed, "names": sorted(served),
            "differ": sorted(name for name, tensor in served.items() if not torch.equal(tensor, reference[name]))}


def test_two_ranks_gather_each_bucket_into_its_slot(tmp_path, free_port):
    from rollout.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path / "qwen2", seed=1, num_layers=6)  # ~5.5 MB float32, 22 buckets
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port)]
    _run([*torchrun, str(Path(__file__)), "--model", str(model), "--out", str(tmp_path / "out.json")])
    results = json.loads((tmp_path / "out.json").read_text())
    for dtype in ("None", "bfloat16"):
        run = results[dtype]
        assert run["new"] == run["old"] and len(run["new"]) == run["buckets"] > 10, dtype
        # The old path holds the whole state dict in host memory; the new one a bucket or two (the sender's two
        # packing buffers) and one tensor at a time for the collectives.
        assert run["old_peak"] >= run["total"], run
        assert run["new_peak"] <= 4 * run["largest_bucket"], run
        assert run["new_peak"] * 3 < run["total"], run
    assert results["after_failure"] == results["None"]["new"]
    published = results["published"]
    assert published["ok"], published["failed"]
    assert published["differ"] == [] and len(published["names"]) > 50


def _run(command: list[str], timeout: float = 300) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(command)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker(args.model, args.out)
