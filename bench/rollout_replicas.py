"""Rollout replicas behind the router: generation throughput with two replicas against one, in the same run.

Setup (real processes on loopback, 1 torch thread each): two `relayrl serve rollout` replicas and the router in
front of both. One round sends the same workload (RL-like: `--groups` prompts of 16-32 tokens, n=8 samples each
at temperature 1, 32 new tokens, all in flight at once) through the router twice: once with the second replica
drained out of routing (RemoveReplica: the baseline, one replica), once after adding it back (AddReplica: two).
Rounds alternate the order; the figure is the median over rounds of tokens/s with two over tokens/s with one.

What it can show here: each replica's engine runs one torch thread, so two replicas can use both cores of this
2-core machine where one uses one (plus its gRPC thread). The machine is shared with other jobs and the router's
and client's own CPU comes out of the same two cores, so the gain is bounded well below 2x; on machines with a
device (or cores) per replica the replicas do not share compute.

    python bench/rollout_replicas.py [--quick]
"""

import argparse
import asyncio
import os
import pathlib
import random
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from protos import rollout_pb2, rollout_pb2_grpc, router_pb2, router_pb2_grpc
from protos.codec import encode_array
from services.client import connect

MAX_TOKENS = 32


def workload(groups: int, seed: int) -> list[rollout_pb2.GenerateRequest]:
    rng = random.Random(seed)
    return [rollout_pb2.GenerateRequest(
        request_id=f"g{seed}-{i}", prompt_ids=encode_array([rng.randrange(3, 100) for _ in range(rng.randint(16, 32))],
                                                           "int32"),
        params=rollout_pb2.SamplingParams(temperature=1.0, n=8, max_tokens=MAX_TOKENS, ignore_eos=True,
                                          seed=rng.randrange(1 << 30))) for i in range(groups)]


async def tokens_per_s(router: str, requests: list[rollout_pb2.GenerateRequest]) -> float:
    async with connect(router) as channel:
        stub = rollout_pb2_grpc.RolloutStub(channel)
        started = time.perf_counter()
        replies = await asyncio.gather(*(stub.Generate(r, timeout=600) for r in requests))
        elapsed = time.perf_counter() - started
    return sum(c.token_ids.length for reply in replies for c in reply.completions) / elapsed


async def set_replicas(router: str, second: str, two: bool) -> None:
    async with connect(router) as channel:
        control = router_pb2_grpc.ReplicasStub(channel)
        listed = await control.ListReplicas(router_pb2.ListReplicasRequest(), timeout=10)
        if two == any(info.address == second for info in listed.replicas):
            return
        if two:
            info = await control.AddReplica(router_pb2.AddReplicaRequest(address=second, wait_s=30), timeout=60)
            assert info.state == router_pb2.REPLICA_STATE_ACTIVE, info
        else:
            await control.RemoveReplica(router_pb2.RemoveReplicaRequest(address=second), timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 16 groups (under a minute)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--groups", type=int, default=48, help="prompts per workload (8 samples each)")
    args = parser.parse_args()
    rounds, groups = (2, 16) if args.quick else (args.rounds, args.groups)

    from deploy.local.service_process import start_service
    from rollout.model.tiny import write_tiny_model

    folder = pathlib.Path(tempfile.mkdtemp(prefix="relayrl-bench-replicas-"))
    model = str(write_tiny_model(folder / "qwen2", seed=0))
    engine = {"model": model, "engine.torch_threads": 1, "engine.max_model_len": 256}
    replicas = [start_service("rollout", engine, log_dir=folder, label=f"rollout-{i}") for i in (1, 2)]
    router = start_service("rollout", {"model": model, "router.replicas": [r.address for r in replicas],
                                       "router.poll_s": 0.2}, log_dir=folder, label="router")
    try:
        asyncio.run(tokens_per_s(router.address, workload(4, seed=999)))  # warm both
        one, two, ratios = [], [], []
        for i in range(rounds):
            measured = {}
            for use_two in ((False, True) if i % 2 == 0 else (True, False)):
                asyncio.run(set_replicas(router.address, replicas[1].address, use_two))
                measured[use_two] = asyncio.run(tokens_per_s(router.address, workload(groups, seed=i)))
            one.append(measured[False])
            two.append(measured[True])
            ratios.append(measured[True] / measured[False])
            print(f"round {i}: one replica {measured[False]:8.0f} tok/s   two replicas {measured[True]:8.0f} tok/s   "
                  f"ratio {ratios[-1]:.2f}", flush=True)
        print(f"median tok/s: one {statistics.median(one):.0f}, two {statistics.median(two):.0f} "
              f"({groups} groups x 8 samples x {MAX_TOKENS} tokens, {rounds} rounds, cores: {os.cpu_count()})")
        print(f"result: tokens_per_s_two_replicas_over_one = {statistics.median(ratios):.2f} (baseline one replica "
              f"behind the same router, target > 1; bounded by the {os.cpu_count()} shared cores here)")
    finally:
        for service in (router, *replicas):
            service.stop(timeout=10)


if __name__ == "__main__":
    main()
