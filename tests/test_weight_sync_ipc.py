"""Receivers on the trainer's own GPU get CUDA IPC handles (services/weights/cuda_ipc.py).

Anywhere: which backend a group is formed with, from where its members stage (the pure choice, and every member
making the same one at the check-in on a real TCP store, members as threads, GPU identities given); the handle's
encoding, the device mapped by GPU UUID; and the store protocol of the IPC transfer (share, copy, acknowledge,
deadlines) with memory named in-process instead of by CUDA. The `gpu` tests run it for real: buckets reach a
process on the trainer's GPU bit-exact, and a whole publish reaches a rollout service on that GPU.
"""

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from services.weights import (
    BucketSender,
    GroupSpec,
    TransferError,
    TransferTimeout,
    allocate_staging,
    backends,
    deadline_after,
    host_store,
    make_group,
    plan_buckets,
    receive_buckets,
    send_buckets,
    unpack_buckets,
)
from services.weights.cuda_ipc import CudaIpcTransfer, choose_backend, decode_handle, encode_handle
from services.weights.gloo import GlooTransfer

A, B = "host/GPU-aaaa", "host/GPU-bbbb"


def test_a_group_all_on_the_trainers_gpu_is_formed_as_cuda_ipc_whatever_its_backend():
    for backend in ("gloo", "nccl", "cupy_nccl", "cuda_ipc"):
        assert choose_backend(backend, [A, A, A], ipc_allowed=True) == "cuda_ipc"
    for backend in ("gloo", "nccl", "cupy_nccl"):
        assert choose_backend(backend, [A, B], ipc_allowed=True) == backend  # a receiver on another GPU
    assert choose_backend("nccl", [A, A], ipc_allowed=False) == "nccl"  # turned off: NCCL's refusal applies
    assert choose_backend("gloo", [A, A, B], ipc_allowed=True) == "gloo"  # one receiver elsewhere: one backend
    assert choose_backend("gloo", ["host/cpu", "host/cpu"], ipc_allowed=True) == "gloo"  # no GPU to share
    assert choose_backend("nccl", ["h1/GPU-aaaa", "h2/GPU-aaaa"], ipc_allowed=True) == "nccl"  # another host
    with pytest.raises(TransferError, match="rank 2: host/GPU-bbbb"):
        choose_backend("cuda_ipc", [A, A, B], ipc_allowed=True)
    with pytest.raises(TransferError, match="turned off"):
        choose_backend("cuda_ipc", [A, A], ipc_allowed=False)


def _form(monkeypatch, backend: str, devices: list[str], cuda_ipc: bool = True) -> list:
    """make_group on every member (threads, a real TCP store), each staging on devices[rank]; "cuda:0" is GPU A and
    "cuda:1" GPU B; what each member formed, or the error it raised."""
    identities = {"cpu": "host/cpu", "cuda:0": A, "cuda:1": B}
    monkeypatch.setattr(backends, "device_identity", lambda device: identities[str(device)])
    store = host_store("127.0.0.1", timeout_s=20)
    name = f"choose-{uuid.uuid4().hex[:6]}"

    def member(rank: int):
        spec = GroupSpec(backend, "127.0.0.1", store.port, len(devices), rank, name)
        try:
            if rank == 0:
                return make_group(spec, 20, store, devices[0], cuda_ipc=cuda_ipc)
            return make_group(spec, 20, device=devices[rank])
        except TransferError as exc:
            return exc

    with ThreadPoolExecutor(len(devices)) as pool:
        return list(pool.map(member, range(len(devices))))


def test_every_member_picks_the_same_backend_at_the_check_in(monkeypatch):
    formed = _form(monkeypatch, "gloo", ["cuda:0", "cuda:0", "cuda:0"])
    assert all(isinstance(group, CudaIpcTransfer) and group.device == torch.device("cuda", 0) for group in formed)
    formed = _form(monkeypatch, "gloo", ["cuda:0", "cuda:0", "cuda:1"])  # one receiver on another GPU: gloo for all
    assert all(isinstance(group, GlooTransfer) for group in formed)
    for group in formed:
        group.close()
    formed = _form(monkeypatch, "gloo", ["cuda:0", "cuda:0"], cuda_ipc=False)  # the trainer says no: gloo
    assert all(isinstance(group, GlooTransfer) for group in formed)
    for group in formed:
        group.close()
    # NCCL with a receiver on the trainer's GPU and one elsewhere: refused by name at the check-in, before NCCL.
    formed = _form(monkeypatch, "nccl", ["cuda:0", "cuda:0", "cuda:1"])
    for refused in formed[:2]:
        assert isinstance(refused, TransferError) and f"ranks 0 and 1 are both on GPU {A}" in str(refused)


def test_a_handle_names_the_gpu_by_uuid_and_opens_on_this_process_index_of_it():
    args = (torch.Tensor, torch.Size([4096]), (1,), 128, torch.storage.TypedStorage, torch.uint8, 3, b"\x01handle",
            1 << 20, 4096, False, b"/ref-counter", 7, b"\x02event", True)
    payload = encode_handle(args, "GPU-uuid-of-3")
    assert b"torch" not in payload  # msgpack of plain fields: no pickle on the wire
    decoded = decode_handle(payload, {"GPU-other": 0, "GPU-uuid-of-3": 1})
    assert decoded == (*args[:6], 1, *args[7:])  # the same arguments, on this process's index of that GPU
    with pytest.raises(TransferError, match="not visible to this process"):
        decode_handle(payload, {"GPU-other": 0})
    with pytest.raises(TransferError, match="uint8 buckets"):
        encode_handle((*args[:5], torch.float32, *args[6:]), "GPU-uuid-of-3")


_SHARED: dict[bytes, torch.Tensor] = {}  # what InProcessHandles shared, by name


class InProcessHandles:
    """Memory named by a key in this process (members are threads): the IPC transfer's store protocol on CPU."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s

    def share(self, bucket: torch.Tensor) -> bytes:
        key = uuid.uuid4().hex.encode()
        _SHARED[key] = bucket
        return key

    def copy_into(self, out: torch.Tensor, payload: bytes) -> None:
        time.sleep(self.delay_s)  # a slow receiver: the sender must not refill the bucket before it copied
        out.copy_(_SHARED[payload])


def _ipc_members(world: int, name: str, delays=None) -> list[CudaIpcTransfer]:
    store = host_store("127.0.0.1", timeout_s=20)
    members = []
    for rank in range(world):
        member_store = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, None, False)
        spec = GroupSpec("cuda_ipc", "127.0.0.1", store.port, world, rank, name)
        handles = InProcessHandles((delays or {}).get(rank, 0.0))
        members.append(CudaIpcTransfer(spec, dist.PrefixStore(f"{name}/", member_store), torch.device("cpu"), handles))
    return members


def test_the_ipc_protocol_lands_every_bucket_and_reuses_none_before_every_receiver_copied_it():
    gen = torch.Generator().manual_seed(4)
    weights = {f"layers.{i}.w": torch.randn(48, generator=gen) for i in range(9)}
    manifest = plan_buckets(weights, bucket_bytes=400)  # 9 buckets through the sender's 2 packing buffers
    sender, *receivers = _ipc_members(3, "protocol", delays={2: 0.01})
    with ThreadPoolExecutor(2) as pool:
        for version in range(2):  # the group carries several updates
            stagings = [allocate_staging(manifest, torch.device("cpu")) for _ in receivers]
            pending = [pool.submit(receive_buckets, r, manifest, deadline_after(20), s) for r, s in zip(receivers, stagings)]
            BucketSender().send(sender, manifest, {n: t + version for n, t in weights.items()}, deadline_after(20))
            for future, staging in zip(pending, stagings):
                future.result(timeout=20)
                got = unpack_buckets(manifest, staging)
                assert all(torch.equal(got[n], t + version) for n, t in weights.items())
    assert not sender.store.check(["ipc/0", "ipc/17"])  # each bucket's keys are gone once every receiver copied it


def test_ipc_waits_end_at_their_deadlines():
    manifest = plan_buckets({"w": torch.ones(64)}, bucket_bytes=1024)
    sender, receiver = _ipc_members(2, "nobody-copies")
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match="0 of 1 receivers copied it"):
        send_buckets(sender, manifest, {"w": torch.ones(64)}, deadline_after(0.5))
    sender, receiver = _ipc_members(2, "silent-sender")
    with pytest.raises(TransferTimeout, match="no handle from the trainer"):
        receive_buckets(receiver, manifest, deadline_after(0.5), allocate_staging(manifest, torch.device("cpu")))
    assert time.monotonic() - started < 5
    sender.close(wait_s=5)
    with pytest.raises(TransferError, match="released"):
        sender.broadcast(torch.zeros(8, dtype=torch.uint8))


# -- on a GPU ----------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_buckets_reach_a_process_on_the_trainers_gpu_through_ipc_handles(backend):
    from test_weight_sync_nccl import _send_twice

    assert _send_twice(backend, f"one-gpu-ipc-{backend}", "cuda:0") is CudaIpcTransfer


@pytest.mark.gpu
def test_a_publish_reaches_a_rollout_service_on_the_trainers_gpu(tiny_model_dir, tmp_path):
    """The whole protocol through CUDA IPC: a trainer on cuda:0 configured for NCCL, a rollout service whose engine is
    on cuda:0 too; weights gathered on the GPU into the shared buckets (ShardedWeights over whole CUDA tensors); the
    engine then serves them, and reports its pause."""
    from transformers import AutoModelForCausalLM

    from deploy.local.service_process import start_service
    from tests.serve_check_kit import assert_served, greedy_completion
    from trainer.broadcast.broadcaster import WeightBroadcaster
    from trainer.broadcast.config import BroadcastConfig
    from trainer.broadcast.gather import ShardedWeights

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to("cuda:0")
    gen = torch.Generator().manual_seed(2)
    weights = {name: t + (torch.randn(t.shape, generator=gen) * 0.05).to(t.device) for name, t in model.state_dict().items()}
    service = start_service("rollout", {"model": str(tiny_model_dir), "engine.device": "cuda:0", "engine.dtype": "float32"},
                            log_dir=tmp_path)
    try:
        async def publish():
            config = BroadcastConfig(backend="nccl", bucket_mb=0.05, timeout_s=60)
            async with WeightBroadcaster([service.address], config, device="cuda:0") as broadcaster:
                report = await broadcaster.publish(ShardedWeights(weights, "cuda:0"), 1)
                return report, type(broadcaster._transport._group.transfer)

        report, transfer = asyncio.run(publish())
        assert report.ok, report.failed
        assert transfer is CudaIpcTransfer and 0 < report.pause_s <= report.total_s
        completion = greedy_completion(service.address)
    finally:
        service.stop(timeout=10)
    assert_served(completion, model, weights, version=1)
