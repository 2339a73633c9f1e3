"""Agentic rollouts under KV pressure: engine.session_policy kv_aware (expected-return scheduling, an int8 host tier,
admission by KV) against lru (the engine before them: no tier, least recently used out first), the same total KV
bytes for both (cache, plus tier for kv_aware), the same model, workload and seed.

Model: a random tiny Qwen2 written in code (hidden 256, 4 layers, 4 heads, 2 kv heads, head_dim 64, float32; 4 KiB of
KV per token), on this machine's CPU, one engine in this process (rollout/engine/llm_engine.py).

Workload (synthetic multi-turn tool use): EPISODES episodes, CONCURRENCY sessions open at once (a new one opens when
one closes). Each opens on a PROMPT-token context, then TURNS policy turns of GEN greedy tokens (ignore_eos), a tool
call after each but the last, and an OBS-token observation appended before the next turn. Tool latencies (seconds,
seeded): 70% fast, uniform(0.05, 0.3); 30% slow, uniform(3, 8); each turn tells the engine its tool's latency
(expected_idle_s, exact); prompts, observations and latencies are drawn per episode and turn, so every policy plays
the same ones. Time is virtual: the engine's steps advance it by the CPU time they took (time.thread_time, one torch
thread: other processes on a shared machine do not count), tools by their latency (the engine idles only when every
open session waits on a tool).

Pressure: total KV bytes = PRESSURE x the workload's working set (CONCURRENCY full contexts, in float32 blocks);
lru: all of it as cache; kv_aware: 60% cache, 40% int8 tier (rollout/kv/host_tier.py), session_admission kv (wait
bound 5 s). No pressure: total = 2 x the working set, split the same way. Under pressure a third run, lru+tier
(lru's order over kv_aware's cache and tier, no admission), says how much of the difference is the tier's. With
--tight the three runs under pressure use TIGHT x the working set instead (the tier cannot hold every idle session, so
whose KV leaves first, what the tier drops and admission matter), printed as *_tight, and nothing else runs.

- recomputed tokens: prefill tokens beyond what a session that never lost its KV computes (its prompt once, then
  the last sampled token and the observation per turn).
- turns/s: policy turns / virtual seconds; episode latency: from asking to open to close; admission wait: from
  asking to open to being admitted.

    python bench/agentic_kv.py [--quick] [--tight]
"""

import argparse
import os
import random
import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from rollout.config import EngineConfig
from rollout.engine.errors import NotAdmitted
from rollout.engine.llm_engine import LLMEngine
from rollout.engine.sampling_params import SamplingParams
from rollout.model.tiny import write_tiny_model

BLOCK = 16
PRESSURE = 0.45
TIGHT = 0.25
ADMISSION_WAIT_S = 5.0


@dataclass(frozen=True)
class Shape:
    episodes: int = 128
    concurrency: int = 64
    prompt: int = 384
    turns: int = 4
    gen: int = 16
    obs: int = 48

    @property
    def context(self) -> int:
        return self.prompt + self.turns * self.gen + (self.turns - 1) * self.obs


@dataclass
class Agent:
    session_id: str
    asked_at: float
    opened_at: float = 0.0
    turns: int = 0
    ready_at: float = 0.0
    running: bool = False
    next_idle_s: float = 0.0


def tool_latency(rng: random.Random) -> float:
    return rng.uniform(0.05, 0.3) if rng.random() < 0.7 else rng.uniform(3.0, 8.0)


def tokens(seed: int, what: str, count: int) -> list[int]:
    rng = random.Random(f"{seed}/{what}")
    return [rng.randrange(3, 100) for _ in range(count)]


def run(model_dir: Path, shape: Shape, policy: str, total_bytes: int, seed: int) -> dict:
    bytes_per_block = 2 * 4 * BLOCK * 2 * 64 * 4  # keys and values, 4 layers, 2 kv heads, head_dim 64, float32
    settings = {"session_policy": "kv_aware" if policy == "kv_aware" else "lru"}
    cache_bytes = total_bytes
    if policy != "lru":
        cache_bytes = int(total_bytes * 0.6)
        settings |= {"session_kv_tier_bytes": total_bytes - cache_bytes, "session_kv_tier_codec": "int8"}
    if policy == "kv_aware":
        settings |= {"session_admission": "kv", "session_admission_wait_s": ADMISSION_WAIT_S}
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=BLOCK, num_blocks=cache_bytes // bytes_per_block,
                                    max_model_len=shape.context + BLOCK, max_num_seqs=shape.concurrency,
                                    max_num_batched_tokens=4096, seed=seed, **settings))
    now = 0.0

    def clock() -> float:
        return now

    table = engine.sessions  # virtual time for the sessions' idle times, pins and admission waits
    table.clock = table.policy.clock = table.admission.clock = clock
    params = SamplingParams(temperature=0, max_tokens=shape.gen, ignore_eos=True)
    pending = deque(range(shape.episodes))
    asked: dict[int, float] = {}
    live: dict[str, Agent] = {}
    turn_of: dict[str, Agent] = {}
    latencies, waits = [], []
    minimal_prefill = turns = 0
    while pending or live:
        while pending and len(live) < shape.concurrency:
            index = pending[0]
            asked.setdefault(index, now)
            try:
                engine.open_session(f"ep{index}", tokens(seed, f"ep{index}", shape.prompt))
            except NotAdmitted:
                break
            pending.popleft()
            waits.append(now - asked[index])
            live[f"ep{index}"] = Agent(f"ep{index}", asked[index], opened_at=now, ready_at=now)
            minimal_prefill += shape.prompt
        for agent in live.values():
            if agent.running or agent.ready_at > now:
                continue
            if agent.turns:
                engine.append_to_session(agent.session_id, tokens(seed, f"{agent.session_id}/{agent.turns}", shape.obs))
                minimal_prefill += 1 + shape.obs
            last = agent.turns == shape.turns - 1
            agent.next_idle_s = 0.0 if last else tool_latency(random.Random(f"{seed}/{agent.session_id}/{agent.turns}"))
            request_id = f"{agent.session_id}/{agent.turns}"
            engine.add_session_request(request_id, agent.session_id, params, agent.next_idle_s)
            agent.running = True
            turn_of[request_id] = agent
        if engine.has_unfinished_requests():
            started = time.thread_time()
            outputs = engine.step()
            now += time.thread_time() - started
            for out in outputs:
                if out.finish_reason is None:
                    continue
                agent = turn_of.pop(out.request_id)
                agent.running, agent.turns = False, agent.turns + 1
                turns += 1
                if agent.turns == shape.turns:
                    engine.close_session(agent.session_id)
                    del live[agent.session_id]
                    latencies.append(now - agent.asked_at)
                else:
                    agent.ready_at = now + agent.next_idle_s
        else:  # every open session waits on its tool (or on admission): skip to the next event
            events = [a.ready_at for a in live.values() if not a.running]
            if pending and pending[0] in asked:
                events.append(asked[pending[0]] + ADMISSION_WAIT_S)
            now = max(now, min(events))
    stats = engine.stats
    quantiles = statistics.quantiles(latencies, n=20)
    return {"recomputed": stats["prefill_tokens"] - minimal_prefill, "turns_per_s": turns / now, "seconds": now,
            "p50": statistics.median(latencies), "p95": quantiles[18], "max_wait": max(waits),
            "tier_hits": stats["session_tier_hits"], "tier_bytes_moved": stats["session_tier_bytes_out"]
            + stats["session_tier_bytes_in"], "restored": stats["session_tier_tokens_restored"],
            "queued": stats["sessions_queued_total"], "evictions": stats["session_evictions"],
            "misses": stats["session_tier_misses"], "dropped": stats["session_tier_dropped"],
            "preemptions": stats["preemptions"],
            "cache_blocks": engine.block_manager.num_blocks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="32 episodes, 16 at once, 2 turns: a smoke run")
    parser.add_argument("--tight", action="store_true", help=f"only the runs under pressure, at {TIGHT} x the "
                        "working set")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    shape = Shape(episodes=32, concurrency=16, turns=2) if args.quick else Shape()
    working_set = shape.concurrency * -(-shape.context // BLOCK) * (2 * 4 * BLOCK * 2 * 64 * 4)
    print(f"shape: {shape.episodes} episodes, {shape.concurrency} sessions at once, prompt {shape.prompt} tokens, "
          f"{shape.turns} turns of {shape.gen} tokens, observations of {shape.obs} (context up to {shape.context}); "
          f"working set {working_set / 2**20:.1f} MiB of float32 KV")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(Path(tmp) / "model", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                                     head_dim=64, max_position_embeddings=2048, seed=args.seed)
        results = {}
        budgets = [("pressure", int(working_set * (TIGHT if args.tight else PRESSURE)))]
        budgets += [] if args.tight else [("roomy", working_set * 2)]
        for label, total in budgets:
            for policy in ("lru", "kv_aware", "lru+tier") if label == "pressure" else ("lru", "kv_aware"):
                r = results[label, policy] = run(model_dir, shape, policy, total, args.seed)
                print(f"{label:8s} {policy:8s} total KV {total / 2**20:6.1f} MiB, cache {r['cache_blocks']} blocks: "
                      f"{r['turns_per_s']:.2f} turns/s over {r['seconds']:.1f} s, recomputed {r['recomputed']} tokens, "
                      f"p50 {r['p50']:.2f} s, p95 {r['p95']:.2f} s, longest admission wait {r['max_wait']:.2f} s, "
                      f"evictions {r['evictions']}, tier hits {r['tier_hits']} ({r['restored']} tokens, "
                      f"{r['tier_bytes_moved'] / 2**20:.1f} MiB moved; misses {r['misses']}, dropped {r['dropped']}), "
                      f"queued {r['queued']}, preemptions {r['preemptions']}", flush=True)
    lru, aware = results["pressure", "lru"], results["pressure", "kv_aware"]
    tag = "_tight" if args.tight else ""
    print(f"result: kv_aware_vs_lru_recomputed_tokens{tag} = {aware['recomputed'] / max(lru['recomputed'], 1):.3f} "
          f"(baseline lru {lru['recomputed']} tokens, kv_aware {aware['recomputed']}; gate <= 0.3)")
    print(f"result: kv_aware_vs_lru_turns_per_s{tag} = {aware['turns_per_s'] / lru['turns_per_s']:.2f} "
          f"(baseline lru {lru['turns_per_s']:.2f} turns/s, kv_aware {aware['turns_per_s']:.2f}; target >= 1.3)")
    for policy, r in (("lru", lru), ("kv_aware", aware)):
        print(f"result: episode_latency_{policy}{tag} = p50 {r['p50']:.2f} s, p95 {r['p95']:.2f} s; longest admission "
              f"wait {r['max_wait']:.2f} s (under pressure)")
    tiered = results["pressure", "lru+tier"]
    print(f"result: lru_with_tier_vs_lru_turns_per_s{tag} = {tiered['turns_per_s'] / lru['turns_per_s']:.2f} (baseline lru; "
          f"recomputed tokens {tiered['recomputed'] / max(lru['recomputed'], 1):.3f} of lru's: the tier alone)")
    if args.tight:
        return
    roomy_lru, roomy_aware = results["roomy", "lru"], results["roomy", "kv_aware"]
    print(f"result: kv_aware_vs_lru_turns_per_s_no_pressure = "
          f"{roomy_aware['turns_per_s'] / roomy_lru['turns_per_s']:.3f} (baseline lru {roomy_lru['turns_per_s']:.2f} "
          f"turns/s; target within 5%)")


if __name__ == "__main__":
    main()
