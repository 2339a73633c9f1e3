"""Weight sync over NCCL, both backends: torch's ProcessGroupNCCL (services/weights/nccl.py) and cupy's NCCL
bindings (services/weights/cupy_nccl.py).

The `gpu` tests run each member as a process of its own on the GPU it names (the receiver is spawned), as a
trainer and a rollout worker are: buckets land bit-exact on another GPU, a silent sender times a receive out
at its deadline, two members on one GPU are refused by name before NCCL is touched (when the trainer turned CUDA
IPC off; on, they get IPC handles: tests/test_weight_sync_ipc.py), and a publish reaches a
rollout service on another GPU. The others run anywhere: the explicit device choice, the check-in that comes
before NCCL (on a real TCP store), and the trainer's and receiver's refusals of a backend they cannot carry.
"""

import asyncio
import multiprocessing
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

from services.weights import (
    GroupSpec,
    TransferError,
    allocate_staging,
    deadline_after,
    host_store,
    make_group,
    plan_buckets,
    receive_buckets,
    send_buckets,
    transfer_device,
    unpack_buckets,
)
from services.weights.nccl_rendezvous import check_in

BACKENDS = ["nccl", "cupy_nccl"]


def _weights(device: str) -> dict[str, torch.Tensor]:
    """What a trainer sends: several dtypes, a non-contiguous tensor, several buckets of 512 bytes."""
    gen = torch.Generator().manual_seed(1)
    cpu = {
        "embed.weight": torch.randn(64, 32, generator=gen),  # a bucket of its own, sent from its memory
        "norm.weight": torch.randn(32, generator=gen).to(torch.bfloat16),
        "proj.weight": torch.randn(16, 8, generator=gen).t(),  # not contiguous: packed
        "proj.bias": torch.randn(8, generator=gen),
        "step": torch.tensor([7], dtype=torch.int64),
    }
    return {name: tensor.to(device) for name, tensor in cpu.items()}


def _manifest():
    return plan_buckets(_weights("cpu"), bucket_bytes=512)


def _receive(backend: str, port: int, name: str, device: str, rounds: int, deadline_s: float, out) -> None:
    """Rank 1, in a process of its own: join on `device`, receive `rounds` updates, and put on `out` the names of
    the tensors that differ from the sender's in each ("ok", [[...], ...]), or the error (its class, its text)."""
    group = None
    try:
        manifest = _manifest()
        group = make_group(GroupSpec(backend, "127.0.0.1", port, 2, 1, name), timeout_s=30, device=device)
        expected = _weights("cpu")
        differing = []
        for _ in range(rounds):
            staging = allocate_staging(manifest, group.device)
            receive_buckets(group, manifest, deadline_after(deadline_s), staging)
            got = unpack_buckets(manifest, staging)
            differing.append(sorted(n for n, t in expected.items()
                                    if got[n].device != torch.device(device) or not torch.equal(got[n].cpu(), t)))
        out.put(("ok", differing))
    except TransferError as exc:
        out.put((type(exc).__name__, str(exc)))
    finally:
        if group is not None:
            group.close(wait_s=5)


def _spawn(*args):
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_receive, args=(*args, out), daemon=True)
    process.start()
    return process, out


def _needs(backend: str, gpus: int) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs, this machine has {torch.cuda.device_count()}")
    if backend == "cupy_nccl":
        pytest.importorskip("cupy")


def _finish(process) -> None:
    process.join(30)
    if process.is_alive():
        process.kill()
        process.join(5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_buckets_reach_a_process_on_another_gpu_bit_exact(backend):
    _needs(backend, 2)
    _send_twice(backend, f"two-gpus-{backend}", "cuda:1")


def _send_twice(backend: str, name: str, receiver_device: str) -> type:
    """Two updates from cuda:0 to a receiving process on `receiver_device`, each bucket checked bit-exact there
    (the group carries several updates; the packing buffers are reused); the sender's transfer type."""
    store = host_store("127.0.0.1", timeout_s=30)
    process, out = _spawn(backend, store.port, name, receiver_device, 2, 30.0)
    try:
        sender = make_group(GroupSpec(backend, "127.0.0.1", store.port, 2, 0, name), timeout_s=30, store=store,
                            device="cuda:0")
        assert sender.device == torch.device("cuda:0")
        weights = _weights("cuda:0")
        for _ in range(2):
            send_buckets(sender, _manifest(), weights, deadline_after(30))
        assert out.get(timeout=60) == ("ok", [[], []])
        sender.close(wait_s=5)
        return type(sender)
    finally:
        _finish(process)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_receive_from_a_silent_sender_times_out_at_its_deadline(backend):
    _needs(backend, 2)
    store = host_store("127.0.0.1", timeout_s=30)
    name = f"silent-{backend}"
    process, out = _spawn(backend, store.port, name, "cuda:1", 1, 1.0)
    try:
        sender = make_group(GroupSpec(backend, "127.0.0.1", store.port, 2, 0, name), timeout_s=30, store=store,
                            device="cuda:0")
        started = time.monotonic()
        kind, message = out.get(timeout=60)  # nothing is sent
        assert kind == "TransferTimeout", message
        assert time.monotonic() - started < 20  # the group's forming and 1 s of waiting, not the 30 s timeout
        sender.close(wait_s=5)
    finally:
        _finish(process)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_trainer_and_a_receiver_on_one_gpu_are_refused_by_name(backend):
    """NCCL needs one GPU per member: both sides learn it from the check-in, within the rendezvous (with CUDA IPC
    turned off by the trainer; on, such a group carries IPC handles: tests/test_weight_sync_ipc.py)."""
    _needs(backend, 1)
    store = host_store("127.0.0.1", timeout_s=30)
    name = f"one-gpu-{backend}"
    process, out = _spawn(backend, store.port, name, "cuda:0", 1, 10.0)
    try:
        with pytest.raises(TransferError, match="ranks 0 and 1 are both on GPU"):
            make_group(GroupSpec(backend, "127.0.0.1", store.port, 2, 0, name), timeout_s=30, store=store,
                       device="cuda:0", cuda_ipc=False)
        kind, message = out.get(timeout=60)
        assert kind == "TransferError" and "ranks 0 and 1 are both on GPU" in message
    finally:
        _finish(process)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_publish_reaches_a_rollout_service_on_another_gpu(backend, tiny_model_dir, tmp_path):
    """The whole protocol: a WeightBroadcaster on cuda:0, a rollout service whose engine is on cuda:1; after the
    publish the service's logprobs are the published weights' (transformers, teacher-forced on its tokens)."""
    _needs(backend, 2)
    from transformers import AutoModelForCausalLM

    from deploy.local.service_process import start_service
    from tests.serve_check_kit import assert_served, greedy_completion
    from trainer.broadcast.broadcaster import WeightBroadcaster
    from trainer.broadcast.config import BroadcastConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval().to("cuda:0")
    gen = torch.Generator().manual_seed(2)
    weights = {name: t + (torch.randn(t.shape, generator=gen) * 0.05).to(t.device) for name, t in model.state_dict().items()}
    service = start_service("rollout", {"model": str(tiny_model_dir), "engine.device": "cuda:1", "engine.dtype": "float32"},
                            log_dir=tmp_path)
    try:
        async def publish():
            config = BroadcastConfig(backend=backend, bucket_mb=0.05, timeout_s=60)
            async with WeightBroadcaster([service.address], config, device="cuda:0") as broadcaster:
                return await broadcaster.publish(weights, 1)

        report = asyncio.run(publish())
        assert report.ok, report.failed
        completion = greedy_completion(service.address)
    finally:
        service.stop(timeout=10)
    assert_served(completion, model, weights, version=1)


def test_the_nccl_backends_run_on_the_cuda_device_named_with_its_index():
    """Not whatever device is current in the calling thread (a gRPC handler's is cuda:0)."""
    assert transfer_device("gloo", None) == torch.device("cpu")
    assert transfer_device("gloo", "cuda:1") == torch.device("cpu")
    assert transfer_device("nccl", "cuda:1") == torch.device("cuda", 1)
    assert transfer_device("nccl", torch.device("cuda", 3)) == torch.device("cuda", 3)
    for device in (None, "cpu", "cuda"):
        with pytest.raises(TransferError, match="needs a CUDA device with its index"):
            transfer_device("nccl", device)
    with pytest.raises(TransferError, match="cuda:N"):
        transfer_device("cupy_nccl", "cpu")


def test_check_in_refuses_two_members_on_one_gpu_and_times_out_without_a_member():
    """On a real TCP store, members as threads: distinct GPUs pass, a shared one is refused by both members
    naming both ranks, a member that never comes fails everyone at the deadline."""
    def members(name: str, identities: list[str], world: int, timeout_s: float) -> list[str]:
        store = host_store("127.0.0.1", timeout_s=20)

        def member(rank: int) -> str:
            try:
                check_in(dist.PrefixStore(f"{name}/", store), name, rank, world, identities[rank],
                         deadline_after(timeout_s))
            except TransferError as exc:
                return f"{type(exc).__name__}: {exc}"
            return "ok"

        with ThreadPoolExecutor(len(identities)) as pool:
            return list(pool.map(member, range(len(identities))))

    assert members("distinct", ["host/GPU-a", "host/GPU-b", "host/GPU-c"], 3, 10) == ["ok"] * 3
    shared = members("shared", ["host/GPU-a", "host/GPU-b", "host/GPU-a"], 3, 10)
    assert shared[1] == "ok"
    for outcome in (shared[0], shared[2]):
        assert outcome.startswith("TransferError") and "ranks 0 and 2 are both on GPU host/GPU-a" in outcome
    started = time.monotonic()
    missing = members("missing", ["host/GPU-a", "host/GPU-b"], 3, 0.5)
    assert time.monotonic() - started < 5
    assert all(o.startswith("TransferTimeout") and "of 3 members checked in" in o for o in missing), missing


def test_the_trainer_refuses_an_nccl_publish_from_the_cpu():
    from trainer.broadcast.broadcaster import WeightBroadcaster
    from trainer.broadcast.config import BroadcastConfig
    from trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="sends from the trainer's GPU"):
        TrainerConfig(model_path="m", device="cpu", publish={"backend": "nccl", "receivers": ["127.0.0.1:1"]})
    TrainerConfig(model_path="m", device="cpu", publish={"backend": "gloo", "receivers": ["127.0.0.1:1"]})
    with pytest.raises(TransferError, match="cuda:N"):
        WeightBroadcaster(["127.0.0.1:1"], BroadcastConfig(backend="cupy_nccl"), device="cpu")
