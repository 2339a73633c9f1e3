"""`relayrl doctor RUN_DIR`: why a finished or failed run went as it did, each known fault named with its evidence
(file:line and the values there) and its fix.

    the outcome            finished (summary.json) or failed (the supervisor's failure), and what it reached
    restart loops          a process that kept dying (supervisor.jsonl), and how it died (exit code, log)
    out of memory          the allocators' and the kernel's words in any log
    collective timeouts    a process group, rendezvous or weight transfer that timed out
    weight versions        publishes that never reached the rollout, or failed; a served version that stopped moving
    rewards                all zero, or constant (GRPO's advantages are then zero: nothing is learned)
    entropy collapse       the policy's entropy gone to nothing before its reward got anywhere
    data wait              the trainer waiting for batches most of its time; with per-stage step reports, the
                           stage the run is bound by, its evidence and lever (deploy/inspect/bottleneck.py)
    mismatch               rollout-vs-trainer logprob mismatch metrics (`mismatch/*` in trainer_metrics.jsonl),
                           when the run records them, judged by version lag (deploy/inspect/mismatch.py)

The folder is read by deploy/record/run_record.py; findings print as `relayrl doctor EXPERIMENT.yaml`'s do. Exit 1 when a
fault (an error) is found, else 0.
"""

import re
import statistics
from collections import Counter

from deploy.inspect.bottleneck import check_bottleneck, staged
from deploy.inspect.doctor import Finding, report
from deploy.inspect.mismatch import check_mismatch
from deploy.record.run_record import RunRecord, last_error

# Words of a process that ran out of memory (PyTorch, CUDA, the allocator, the kernel, Python).
OOM = (r"CUDA out of memory|OutOfMemoryError|out of memory|Cannot allocate memory|std::bad_alloc|MemoryError"
       r"|oom-kill|Killed process")
# Words of a collective (a process group, its rendezvous, a weight transfer) that timed out.
COLLECTIVE_TIMEOUT = (r"Watchdog caught collective operation timeout|DistStoreError|Socket Timeout"
                      r"|deadline passed before joining the group|(?i:(gloo|nccl|collective|rendezvous|barrier|"
                      r"process group|broadcast|allreduce|all_reduce).{0,80}timed? ?out)"
                      r"|(?i:timed? ?out.{0,80}(gloo|nccl|collective|rendezvous|barrier|process group))")
PUBLISH_FAILED = r"receivers failed|not taken by"


def diagnose_run(run_dir) -> list[Finding]:
    """Every finding about the run in `run_dir`."""
    run = RunRecord(run_dir)
    findings: list[Finding] = []
    for check in (check_outcome, check_restarts, check_memory, check_collectives, check_weight_versions,
                  check_rewards, check_entropy, check_data_wait, check_mismatch):
        check(run, findings)
    return findings


def main(run_dir: str) -> int:
    try:
        findings = diagnose_run(run_dir)
    except FileNotFoundError as exc:
        print(f"relayrl doctor: {exc}")
        return 2
    return report(findings)


# ---------------------------------------------------------------- how it ended, and what kept dying


def check_outcome(run: RunRecord, findings: list[Finding]) -> None:
    failed = [row for row in run.events if row.record.get("event") == "failed"]
    if run.failure:
        findings.append(_failed_run(run, failed))
    elif run.finished:
        s = run.summary
        findings.append(Finding("ok", "outcome", f"finished: {s.get('steps', 0)} optimizer steps in "
                                f"{s.get('rl_seconds', 0):.0f}s of RL, held-out {s.get('sft_accuracy', 0):.3f} -> "
                                f"{s.get('final_accuracy', 0):.3f}"))
    elif failed:
        first = failed[0].record
        findings.append(Finding("error", "outcome", f"the run failed: {first['member']} {first.get('problem', '')}, "
                                f"and {first.get('why', 'it could not recover')}",
                                "see the findings below; `relayrl run --resume RUN_DIR` goes on once it is fixed",
                                [row.cite("member", "event", "problem") for row in failed]))
    else:
        clock = run.read_json("rl_clock.json") or {}
        findings.append(Finding("warn", "outcome", "the run did not finish (no summary.json) and no process failed "
                                f"it: stopped from outside, or still running ({clock.get('rl_seconds', 0):.0f}s of RL "
                                "recorded)", "`relayrl status RUN_DIR` if it runs; `relayrl run --resume RUN_DIR`"))


def _failed_run(run: RunRecord, failed: list) -> Finding:
    """The run ended failed (without training, or a process whose restarts ran out): why, as its summary says, quoting
    the exception's last line from the process's log (a summary of 0 steps written before runs said why gets the
    trainer's here)."""
    cause = run.failure
    error = last_error(run.log("logs/trainer.log"))
    if error is not None and ".log:" not in cause:
        cause += f": {error.cite(width=600)}"
    evidence = [f"summary.json: steps {run.summary.get('steps', 0)}, restarts {run.summary.get('restarts') or 'none'}"]
    evidence += [row.cite("member", "event", "problem") for row in failed]
    fix = ("the error quoted is the cause (the derived ones, a reward of 0 with no step taken, are not reported): fix "
           "what it names (`relayrl doctor EXPERIMENT.yaml` checks a file before a run), then run again or "
           "`relayrl run --resume RUN_DIR`")
    what = "the run failed" if run.summary.get("steps") else "the run could not train"  # it trained, then failed
    return Finding("error", "outcome", f"{what}: {cause}", fix, evidence)


def _how_it_died(problems: Counter) -> str:
    """The likely cause behind the supervisor's words for a death."""
    if any("code -9" in p for p in problems):
        return ("SIGKILL: the kernel's OOM killer (dmesg | grep -i oom) or someone's `kill -9`; lower the process's "
                "memory (trainer batch.micro_batch_size, training.max_tokens) or give it more")
    if any("frozen" in p for p in problems):
        return ("it stopped answering (health check or heartbeat): a deadlock or a stuck collective; py-spy dump "
                "--pid PID while it hangs, or raise supervise.health_timeout_s if it is merely slow")
    if any("failed to start" in p for p in problems):
        return "it could not start again: its port or its files; read the end of its log"
    return "it exited with an error: read the traceback at the end of its log"


def check_restarts(run: RunRecord, findings: list[Finding]) -> None:
    downs: dict[str, list] = {}
    for row in run.events:
        if row.record.get("event") == "down":
            downs.setdefault(row.record["member"], []).append(row)
    if not downs:
        restarts = (run.summary or {}).get("restarts", {})
        if restarts:
            findings.append(Finding("warn", "restarts", f"processes restarted: {restarts} (summary.json; this run "
                                    "recorded no supervisor.jsonl to say why)"))
        else:
            findings.append(Finding("ok", "restarts", "no process died"))
        return
    failed = {row.record["member"] for row in run.events if row.record.get("event") == "failed"}
    for member, rows in downs.items():
        problems = Counter(row.record.get("problem", "") for row in rows)
        told = ", ".join(f"{problem} x{count}" for problem, count in problems.items())
        evidence = [row.cite("member", "event", "problem", "pid") for row in rows[:5]]
        log = f"logs/{member}.log"
        starts = run.grep(r"\(pid \d+\)$|listening on", [log]) if (run.dir / log).exists() else []
        if starts:
            evidence.append(f"{log}: {len(starts)} starts ({', '.join(line.text[:19] for line in starts[:6])})")
        error = last_error(run.log(log))
        if error is not None:
            evidence.append(error.cite())
        if member in failed:
            findings.append(Finding("error", "restart loop", f"{member} went down {len(rows)} times ({told}) until "
                                    "its restarts were exhausted", _how_it_died(problems), evidence))
        else:
            findings.append(Finding("warn", "restarts", f"{member} went down {len(rows)} times ({told}) and was "
                                    "restarted", _how_it_died(problems), evidence))


def check_memory(run: RunRecord, findings: list[Finding]) -> None:
    hits = run.grep(OOM)
    if hits:
        findings.append(Finding("error", "out of memory", f"{len(hits)} log lines say a process ran out of memory",
                                "lower what one step holds: trainer micro-batches (services.trainer.settings: "
                                "{batch.micro_batch_size: N}), training.max_tokens, the rollout's KV cache "
                                "(services.rollout.settings engine.*); or move the process to a bigger device",
                                [line.cite() for line in hits[:5]]))


def check_collectives(run: RunRecord, findings: list[Finding]) -> None:
    hits = run.grep(COLLECTIVE_TIMEOUT)
    if hits:
        findings.append(Finding("error", "collective timeout", f"{len(hits)} log lines say a collective (a process "
                                "group, its rendezvous or a weight transfer) timed out",
                                "a peer died or cannot reach the other: the receivers must reach the trainer's "
                                "publish.master_addr (and its port) and every rank the others; raise "
                                "publish.timeout_s / dist_timeout_s if the transfer is merely slow; NCCL_DEBUG=INFO "
                                "says more on GPUs", [line.cite() for line in hits[:5]]))


# ---------------------------------------------------------------- weights, rewards, entropy, data, mismatch


def check_weight_versions(run: RunRecord, findings: list[Finding]) -> None:
    trainer_logs = [name for name in run.log_names() if name.startswith("logs/trainer")]
    rollout_logs = [name for name in run.log_names() if name.startswith("logs/rollout")]
    failures = run.grep(PUBLISH_FAILED, trainer_logs) if trainer_logs else []
    failed = sorted({int(m.group(1)) for line in failures if (m := re.search(r"version (\d+)", line.text))})
    switched = run.grep(r"switched to weight version", rollout_logs) if rollout_logs else []
    steps = run.trainer[-1].record.get("step", len(run.trainer)) if run.trainer else 0
    if not steps and not failures:
        if (run.driver or run.finished) and not run.failure:  # a run that could not train: the outcome says why
            findings.append(Finding("error", "weight versions", "the trainer took no optimizer step",
                                    "read the end of logs/trainer.log; `relayrl status RUN_DIR` while it runs "
                                    "shows whether the buffer holds batches", [line.cite() for line in
                                                                             run.log("logs/trainer.log")[-3:]]))
        return
    receivers = (run.trainer_config.get("publish") or {}).get("receivers") or []
    rollouts = run.service_address("rollout")
    elsewhere = [r for r in receivers if rollouts and r not in rollouts]
    evidence = [line.cite() for line in failures[:3]]
    if len(failures) > 3:
        evidence.append(f"... {len(failures)} such lines in {', '.join(trainer_logs)}")
    served = [row for row in run.driver if "version" in row.record]
    top = max((row.record["version"] for row in served), default=None)
    stuck = _stuck(served)
    if served:
        evidence.append(served[-1].cite("version", "samples", "elapsed_s") + f" (highest version served: {top})")
    if stuck:
        evidence.append(stuck)
    if rollout_logs and not switched:
        evidence.append(f"{', '.join(rollout_logs)}: no 'switched to weight version' line: it serves its first "
                        "weights (version 0)")
    if elsewhere:
        evidence.append(f"trainer.yaml: publish.receivers {receivers}, but services.json: the rollout listens at "
                        f"{rollouts}")
    if failed and not switched:
        fix = (f"the trainer publishes to {elsewhere}, where no rollout of this run listens: drop publish.receivers "
               "from services.trainer.settings (the run fills it in)" if elsewhere else
               "the rollout must be reachable from the trainer (publish.receivers) and reach back the trainer's "
               "publish.master_addr; check both addresses and any firewall, or raise publish.timeout_s")
        findings.append(Finding("error", "weight versions", f"no weight version reached the rollout: the "
                                f"publishes of versions {_ranges(failed)} failed and none landed, so generation "
                                "stayed on the first weights and the driver admitted nothing beyond max_staleness "
                                f"({steps} optimizer steps)", fix, evidence))
    elif failed:
        findings.append(Finding("warn", "weight versions", f"the publishes of versions {_ranges(failed)} failed "
                                f"(the rollout still reached version {top})", "see the receivers named in the "
                                "evidence: each failure leaves that rollout a version behind until the next publish",
                                evidence))
    elif stuck:
        findings.append(Finding("warn", "weight versions", "the rollout's weight version stopped moving: "
                                f"{stuck.split(': ', 1)[1]}", "the trainer stopped publishing: read the end of "
                                "logs/trainer.log (waiting for batches the driver no longer makes? stuck? dead?)",
                                evidence))
    else:
        findings.append(Finding("ok", "weight versions", f"{steps} optimizer steps, no publish failed" +
                                (f"; the rollout served up to version {top}" if served else "")))


def _stuck(served) -> str:
    """'driver_stats.jsonl:a-b: ...' when the served version stayed the same over the last 30% (20 s at least) of
    the driver's records, else ''."""
    if len(served) < 5:
        return ""
    last = served[-1].record["version"]
    since = next(row for row in served if row.record["version"] == last)
    start, end = served[0].record.get("elapsed_s", 0.0), served[-1].record.get("elapsed_s", 0.0)
    held = end - since.record.get("elapsed_s", 0.0)
    if held < 20 or held < 0.3 * (end - start):
        return ""
    return (f"{served[-1].file}:{since.number}-{served[-1].number}: version {last} served for the last "
            f"{held:.0f}s of the driver's {end:.0f}s")


def _ranges(numbers: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def _series(rows, key: str) -> list[tuple[int, float]]:
    return [(row.number, float(row.record[key])) for row in rows if isinstance(row.record.get(key), int | float)]


def check_rewards(run: RunRecord, findings: list[Finding]) -> None:
    rewards = _series(run.trainer, "reward_mean")
    fix_zero = ("score one good completion with your reward function by hand (is it importable as the reward service "
                "imports it; does it read metadata['answer'], filled from data.answer_field?); give completions "
                "room for an answer (training.max_tokens); read logs/reward.log for its errors")
    if not rewards:
        totals = [row for row in run.driver if row.record.get("samples")]
        # Not when the run could not train: the outcome names the trainer's error, and a reward of 0 is not its cause.
        if totals and not any(row.record.get("reward_sum") for row in totals) and not run.failure:
            findings.append(Finding("error", "rewards", f"every one of the {totals[-1].record['samples']} completions "
                                    "scored 0 (no optimizer step was taken)", fix_zero,
                                    [totals[-1].cite("samples", "reward_sum")]))
        return
    values = [value for _, value in rewards]
    span = f"trainer_metrics.jsonl:{rewards[0][0]}-{rewards[-1][0]}"
    evidence = [f"{span}: reward_mean {values[0]:.4g} at each of {len(values)} steps"]
    grads = _series(run.trainer, "grad_norm")
    if grads and not any(g for _, g in grads):
        evidence.append(f"trainer_metrics.jsonl: grad_norm 0 at each of {len(grads)} steps: nothing was learned")
    if run.driver:
        evidence.append(run.driver[-1].cite("samples", "reward_sum"))
    if all(value == 0 for value in values):
        findings.append(Finding("error", "rewards", f"every completion of all {len(values)} trained batches scored 0: "
                                "GRPO's advantages are all zero and the policy never moves", fix_zero, evidence))
    elif len(values) >= 5 and max(values) == min(values):
        findings.append(Finding("error", "rewards", f"the reward is constant at {values[0]:.4g} over {len(values)} "
                                "batches: every completion of a group scores the same, so GRPO's advantages are zero",
                                "the reward cannot tell completions apart: check it on a good and a bad completion; "
                                "a task the policy always solves (or never) teaches nothing: harder or easier "
                                "prompts", evidence))
    else:
        head, tail = _window(values, first=True), _window(values, first=False)
        findings.append(Finding("ok", "rewards", f"mean training reward {head:.3f} (first batches) -> {tail:.3f} "
                                f"(last), over {len(values)} steps"))


def _window(values: list[float], first: bool) -> float:
    size = max(1, min(20, len(values) // 10 or 1))
    return statistics.fmean(values[:size] if first else values[-size:])


def check_entropy(run: RunRecord, findings: list[Finding]) -> None:
    entropy = _series(run.trainer, "entropy")
    rewards = [value for _, value in _series(run.trainer, "reward_mean")]
    if len(entropy) < 10:
        return
    values = [value for _, value in entropy]
    start, end = _window(values, first=True), _window(values, first=False)
    if start <= 0 or end > 0.1 * start:
        findings.append(Finding("ok", "entropy", f"policy entropy {start:.3f} -> {end:.3f}"))
        return
    best, last = (max(rewards), _window(rewards, first=False)) if rewards else (0.0, 0.0)
    drop = (f"policy entropy fell from {start:.3f} to {end:.3f} nats per token "
            f"(trainer_metrics.jsonl:{entropy[0][0]} -> {entropy[-1][0]})")
    if rewards and _solved(rewards):
        findings.append(Finding("ok", "entropy", f"{drop} as the policy converged on its best reward ({last:.3f})"))
        return
    findings.append(Finding("warn", "entropy collapse", f"{drop} while the training reward stays at {last:.3f} "
                            f"(its best batch: {best:.3f}): the policy stopped exploring before it solved the task",
                            "lower training.lr, add an entropy bonus (algorithm.entropy_coef), clip higher "
                            "(algorithm.clip_eps_high, DAPO's clip-higher) or sample hotter (training.temperature)",
                            [f"trainer_metrics.jsonl:{n}: entropy {v:.4g}" for n, v in (entropy[0], entropy[-1])]))


def _solved(rewards: list[float]) -> bool:
    """Whether the training reward ended at its top: 0.9 or more of a reward within [0, 1]; otherwise (a reward of
    unknown range) within 5% of its spread from its best batch, having risen."""
    first, last, best, worst = _window(rewards, True), _window(rewards, False), max(rewards), min(rewards)
    if 0 <= worst and best <= 1:
        return last >= 0.9
    return last > first and last >= best - 0.05 * (best - worst)


def check_data_wait(run: RunRecord, findings: list[Finding]) -> None:
    reported = staged(run.trainer[1:])  # the first step waited for the first batch ever made
    if len(reported) >= 5:  # per-stage step reports: the bound-by verdict (deploy/inspect/bottleneck.py)
        check_bottleneck(run, reported, findings)
        return
    rows = [row for row in run.trainer[1:]  # the first step waited for the first batch ever made
            if isinstance(row.record.get("pull_s"), int | float) and isinstance(row.record.get("step_s"), int | float)]
    if len(rows) < 5:
        return
    waited = sum(row.record["pull_s"] for row in rows)
    total = sum(row.record["step_s"] for row in rows)
    share = waited / total if total else 0.0
    message = f"the trainer waited for batches {share:.0%} of its time ({waited:.1f}s of {total:.1f}s over {len(rows)} steps)"
    if share <= 0.5:
        findings.append(Finding("ok", "data wait", message))
        return
    findings.append(Finding("warn", "data wait", message + ": generation is the bottleneck, the trainer idles",
                            "more generation: rollout replicas (services.rollout.replicas), more prompts in flight "
                            "(training.concurrency), shorter completions (training.max_tokens), or let generation run "
                            "further ahead (training.max_staleness)",
                            [f"trainer_metrics.jsonl:{rows[0].number}-{rows[-1].number}: pull_s / step_s"]))
