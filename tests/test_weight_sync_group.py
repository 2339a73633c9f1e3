"""The data plane on real gloo groups: bucket streams between members, and every wait's deadline.

Members here are threads of the test process, each with its own ProcessGroupGloo over loopback TCP
(the same code paths as separate processes; the service tests use real processes).
"""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from services.weights import (
    BucketSender,
    GroupSpec,
    TransferError,
    TransferTimeout,
    allocate_staging,
    bind_to_buckets,
    deadline_after,
    host_store,
    make_group,
    merge_order,
    plan_buckets,
    receive_buckets,
    send_buckets,
    unpack_buckets,
)

torch.set_num_threads(1)


def _weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "embed.weight": torch.randn(64, 32, generator=gen),  # 8 KiB: a bucket of its own, sent unpacked
        "norm.weight": torch.randn(32, generator=gen).to(torch.bfloat16),
        "proj.weight": torch.randn(16, 8, generator=gen).t(),  # not contiguous: packed
        "proj.bias": torch.randn(8, generator=gen),
        "step": torch.tensor([7], dtype=torch.int64),
    }


def _specs(store, world: int, name: str) -> list[GroupSpec]:
    return [GroupSpec("gloo", "127.0.0.1", store.port, world, rank, name) for rank in range(world)]


def test_buckets_reach_every_receiver_bit_exact():
    weights = _weights()
    manifest = plan_buckets(weights, bucket_bytes=512)
    assert len(manifest.bucket_sizes) >= 3
    store = host_store("127.0.0.1", timeout_s=20)
    specs = _specs(store, 3, "roundtrip")

    def receiver(spec: GroupSpec) -> dict[str, torch.Tensor]:
        group = make_group(spec, timeout_s=20)
        staging = allocate_staging(manifest, group.device)
        for _ in range(2):  # the group carries several updates
            receive_buckets(group, manifest, deadline_after(20), staging)
        return unpack_buckets(manifest, staging)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(receiver, spec) for spec in specs[1:]]
        sender = make_group(specs[0], timeout_s=20, store=store)
        for _ in range(2):
            send_buckets(sender, manifest, weights, deadline_after(20))
        results = [f.result(timeout=30) for f in futures]
    for received in results:
        for name, tensor in weights.items():
            assert received[name].dtype == tensor.dtype
            assert torch.equal(received[name], tensor), name


def test_a_receive_that_gets_no_data_times_out_at_its_deadline():
    manifest = plan_buckets({"w": torch.zeros(1000)}, bucket_bytes=1 << 20)
    store = host_store("127.0.0.1", timeout_s=20)
    specs = _specs(store, 2, "silent-sender")
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(make_group, specs[1], 20)
        sender = make_group(specs[0], timeout_s=20, store=store)
        receiver = joining.result(timeout=30)
    started = time.monotonic()
    with pytest.raises(TransferTimeout):
        receive_buckets(receiver, manifest, deadline_after(0.5), allocate_staging(manifest, receiver.device))
    assert time.monotonic() - started < 3
    receiver.close()
    sender.close()


def test_a_rendezvous_missing_a_member_fails_within_its_timeout():
    store = host_store("127.0.0.1", timeout_s=20)
    specs = _specs(store, 2, "nobody-comes")
    started = time.monotonic()
    with pytest.raises(TransferTimeout, match="rendezvous"):
        make_group(specs[0], timeout_s=1.0, store=store)
    assert time.monotonic() - started < 5


def test_an_aborted_receive_stops_without_waiting():
    weights = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}
    manifest = plan_buckets(weights, bucket_bytes=1024)
    store = host_store("127.0.0.1", timeout_s=20)
    specs = _specs(store, 2, "aborted")
    cancelled = threading.Event()
    cancelled.set()
    with ThreadPoolExecutor(1) as pool:
        joining = pool.submit(make_group, specs[1], 20)
        sender = make_group(specs[0], timeout_s=20, store=store)
        receiver = joining.result(timeout=30)
    started = time.monotonic()
    with pytest.raises(TransferError, match="aborted"):
        receive_buckets(receiver, manifest, deadline_after(5), allocate_staging(manifest, receiver.device), cancelled)
    assert time.monotonic() - started < 1
    receiver.close()
    sender.close()


def test_bound_parameters_go_out_from_their_own_memory_after_in_place_updates():
    gen = torch.Generator().manual_seed(2)
    params = {name: torch.nn.Parameter(torch.randn(shape, generator=gen)) for name, shape in
              [("a.weight", (16, 8)), ("a.bias", (8,)), ("b.weight", (64, 32)), ("c.weight", (5,))]}
    values = {name: p.detach().clone() for name, p in params.items()}
    manifest = plan_buckets(merge_order([(n, tuple(p.shape), p.dtype) for n, p in params.items()]), bucket_bytes=1024)
    buffers = bind_to_buckets(params, manifest)
    assert all(torch.equal(params[name], value) for name, value in values.items())  # values kept, memory moved
    assert all(any(b.data_ptr() <= p.data_ptr() < b.data_ptr() + b.numel() for b in buffers) for p in params.values())
    store = host_store("127.0.0.1", timeout_s=20)
    specs = _specs(store, 2, "bound")

    def receiver(spec: GroupSpec) -> list[dict[str, torch.Tensor]]:
        group = make_group(spec, timeout_s=20)
        received = []
        for _ in range(2):
            staging = allocate_staging(manifest, group.device)
            receive_buckets(group, manifest, deadline_after(20), staging)
            received.append(unpack_buckets(manifest, staging))
        return received

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(receiver, specs[1])
        sender, bucket_sender = make_group(specs[0], timeout_s=20, store=store), BucketSender()
        bucket_sender.send(sender, manifest, params, deadline_after(20))
        with torch.no_grad():
            for param in params.values():
                param.mul_(2)  # what an optimizer step does
        bucket_sender.send(sender, manifest, params, deadline_after(20))
        first, second = future.result(timeout=30)
    assert bucket_sender._buffers == []  # no bucket needed a packing buffer
    for name, value in values.items():
        assert torch.equal(first[name], value) and torch.equal(second[name], value * 2), name


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* write them) of sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, _, hex_port = local.rpartition(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                    found.add(address)
    return found


def test_rendezvous_store_listens_on_the_configured_interface_only():
    """TCPStore on its own listens on every interface whatever host it is given; a loopback trainer's store
    must not be reachable from other machines."""
    store = host_store("127.0.0.1", timeout_s=10)
    assert _listening_addresses(store.port) == {"0100007F"}  # 127.0.0.1, not 00000000 (any) or :: (any)


def test_rendezvous_store_listens_on_a_fixed_port_when_given():
    """A cluster opens one known port for the weight broadcast's rendezvous (services.trainer.weight_sync.port)."""
    import socket

    from trainer.config.publish import PublishConfig
    from trainer.run import RolloutPublisher

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = host_store("127.0.0.1", timeout_s=10, port=port)
    assert store.port == port and _listening_addresses(port) == {"0100007F"}
    publisher = RolloutPublisher(PublishConfig(receivers=["127.0.0.1:1"], master_addr="127.0.0.1", master_port=port))
    try:  # the trainer's publish config reaches its broadcaster
        assert publisher._broadcaster.broadcaster.config.master_port == port
    finally:
        publisher.close()
