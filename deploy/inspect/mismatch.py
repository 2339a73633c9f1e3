"""`relayrl doctor RUN_DIR` on the rollout-vs-trainer logprob mismatch the trainer records every step (`mismatch/*` in
trainer_metrics.jsonl, trainer/mismatch.py), judged by version lag.

    lag 0      tokens the trainer scores with the weights that sampled them: the two sides should agree up to their
               kernels (float32: ~1e-5 nats). Judged against its own bound: a typical step above LAG0_LEVEL is a real
               disagreement (a dtype cast on publish, a bf16 engine against a float32 trainer), and one step beyond
               the ratio the loss clips is one too (tokens sampled over KV kept across an update carry the new
               version and land here: a few hundredths is one step of policy change, not a fault).
    lag >= 1   tokens sampled `lag` versions before the trainer's: the difference is the policy's own change over those
               steps, which asynchronous RL expects (max_staleness) and the PPO ratio clips. Judged against that clip:
               a step whose mean |difference| is beyond log(1 + clip_eps_high) moved the typical token out of the
               trust region (too high a learning rate, or generation too far ahead). The largest difference of one
               token (abs_max) and the k3 estimate mix every lag: no verdict on them alone.

A run that records mismatch figures without lags (not the trainer's own keys) is judged by spikes over its median.
"""

import math
import statistics

from deploy.inspect.findings import Finding
from deploy.record.run_record import RunRecord

PREFIX = "mismatch/"
LAG0 = f"{PREFIX}abs_mean_lag0"
LAGGED = (f"{PREFIX}abs_mean_lag1", f"{PREFIX}abs_mean_lag2+", f"{PREFIX}abs_mean")
MIXED = (f"{PREFIX}abs_max", f"{PREFIX}k3")
LAG0_LEVEL = 5e-3  # nats: a typical lag-0 step above this is no kernel noise
FIX = ("look at what changed at those steps: a weight version switched in mid-sequence, KV kept across it, a dtype "
       "cast on publish (publish.dtype); an off-policy correction (algorithm.off_policy) bounds the effect")


def check_mismatch(run: RunRecord, findings: list[Finding]) -> None:
    keys = sorted({key for row in run.trainer for key, value in row.record.items()
                   if key.startswith(PREFIX) and isinstance(value, int | float)})
    if not keys:
        return
    if LAG0 not in keys and not any(key in keys for key in LAGGED[:2]):
        for key in keys:
            _spikes(run, key, findings)
        return
    clip = math.log1p(float(((run.trainer_config.get("algorithm") or {}).get("clip_eps_high")) or 0.2))
    if LAG0 in keys:
        _lag0(run, clip, findings)
    for key in (key for key in LAGGED if key in keys):
        _lagged(run, key, clip, findings)
    mixed = [key for key in MIXED if key in keys]
    if mixed:
        figures = ", ".join(f"{key} median {statistics.median(v for _, v in _series(run, key)):.3g}" for key in mixed)
        findings.append(Finding("ok", "mismatch", f"{figures}: every lag together, judged by lag above"))


def _series(run: RunRecord, key: str) -> list[tuple[int, float]]:
    return [(row.number, abs(float(row.record[key]))) for row in run.trainer
            if isinstance(row.record.get(key), int | float)]


def _cite(run: RunRecord, key: str, rows: list[tuple[int, float]]) -> list[str]:
    steps = {row.number: row.record.get("step") for row in run.trainer}
    return [f"trainer_metrics.jsonl:{n}: step {steps.get(n)}, {key} {v:.4g}" for n, v in rows[:5]]


def _lag0(run: RunRecord, clip: float, findings: list[Finding]) -> None:
    series = _series(run, LAG0)
    median = statistics.median(v for _, v in series)
    beyond = [(n, v) for n, v in series if v > clip]
    if median > LAG0_LEVEL:
        findings.append(Finding("warn", "mismatch", f"{LAG0}: median {median:.3g} over {len(series)} steps: the "
                                f"rollout and the trainer disagree on the same weights (above {LAG0_LEVEL:g}, which "
                                "their kernels stay under)", "a dtype cast on publish (publish.dtype), or a bf16 engine "
                                "against a float32 trainer: the same dtype on both sides, or a float32 LM head on both "
                                "(rollout engine.lm_head_fp32, the trainer's twin)", _cite(run, LAG0, series[:1])))
    elif beyond:
        findings.append(Finding("warn", "mismatch spikes", f"{LAG0} went beyond the ratio the loss clips "
                                f"(log(1 + clip_eps_high) = {clip:.3g}) at {len(beyond)} steps (up to "
                                f"{max(v for _, v in beyond):.3g}; median {median:.3g}): tokens of the same weights "
                                "disagreed there", FIX, _cite(run, LAG0, beyond)))
    else:
        findings.append(Finding("ok", "mismatch", f"{LAG0}: median {median:.3g}, at most {max(v for _, v in series):.3g}"
                                f" over {len(series)} steps (same weights: within {LAG0_LEVEL:g} typically, and the "
                                f"clip's {clip:.3g} always)"))


def _lagged(run: RunRecord, key: str, clip: float, findings: list[Finding]) -> None:
    series = _series(run, key)
    median = statistics.median(v for _, v in series)
    beyond = [(n, v) for n, v in series if v > clip]
    if not beyond:
        findings.append(Finding("ok", "mismatch", f"{key}: median {median:.3g}, at most {max(v for _, v in series):.3g} "
                                f"over {len(series)} steps: the policy's own change, within the ratio the loss clips "
                                f"({clip:.3g})"))
        return
    findings.append(Finding("warn", "mismatch spikes", f"{key} went beyond the ratio the loss clips (log(1 + "
                            f"clip_eps_high) = {clip:.3g}) at {len(beyond)} steps (up to {max(v for _, v in beyond):.3g}"
                            f"; median {median:.3g}): the policy moved the typical token out of its trust region "
                            "between sampling and training", "a lower training.lr, or less generation ahead "
                            "(training.max_staleness); an off-policy correction (algorithm.off_policy) bounds the "
                            "effect", _cite(run, key, beyond)))


def _spikes(run: RunRecord, key: str, findings: list[Finding]) -> None:
    """A figure without lags: a step far above its median (10 spreads and 3 medians) is a spike."""
    series = [(n, v) for n, v in _series(run, key)]
    values = [v for _, v in series]
    if len(values) < 5:
        return
    median = statistics.median(values)
    spread = statistics.median(abs(value - median) for value in values) or median or 1e-12
    spikes = [(n, v) for n, v in series if v > median + 10 * spread and v > 3 * median and v > 1e-6]
    if not spikes:
        findings.append(Finding("ok", "mismatch", f"{key}: median {median:.3g}, no spike over {len(values)} steps"))
        return
    findings.append(Finding("warn", "mismatch spikes", f"{key} spiked at {len(spikes)} steps (up to "
                            f"{max(v for _, v in spikes):.3g}; median {median:.3g}): the rollout's logprobs and the "
                            "trainer's disagreed there", FIX, _cite(run, key, spikes)))
