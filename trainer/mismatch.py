"""How far the rollout engine's logprobs are from the trainer's, measured on every step's trained tokens.

Both sides score the same sampled tokens under softmax(logits / T), so on the same weights they should agree;
they drift apart through kernels, precision (a bf16 LM head most of all) and KV computed with older weights.
Per step: the mean and max |rollout - trainer logprob| over the trained tokens, the k3 estimate of
KL(rollout || trainer) (exp(d) - 1 - d with d = trainer - rollout, non-negative), and the mean by version lag
(how many versions behind the trainer the token's policy was: 0, 1, 2 and more). Sums are taken per micro-batch
and added over ranks like every other metric; the max is reduced on its own.
"""

import logging

import torch
import torch.distributed as dist
from prometheus_client import Gauge

from trainer.config.mismatch import MismatchConfig

log = logging.getLogger(__name__)
LAGS = (0, 1, 2)  # the last one counts every lag >= 2
PREFIX = "mismatch/"
MISMATCH = Gauge("relayrl_trainer_logprob_mismatch", "Rollout-vs-trainer logprob mismatch of the last step: abs_mean, "
                 "abs_max, k3, abs_mean_lag0/1/2+", ["stat"])


def mismatch_sums(logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                  versions: torch.Tensor, version: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Sums over one micro-batch's trained tokens (`mask` > 0): |difference|, k3 and token counts, overall and by
    version lag; and the largest |difference|."""
    trained = mask > 0
    diff = (logprobs.detach().float() - rollout_logprobs.float()).masked_fill(~trained, 0.0)
    gap = diff.abs()
    sums = {"abs": gap.sum(), "k3": (torch.expm1(diff) - diff).sum(), "tokens": trained.sum().float()}
    lag = (version - versions).clamp(min=0)
    for k in LAGS:
        at = trained & ((lag == k) if k < LAGS[-1] else (lag >= k))
        sums[f"abs_lag{k}"] = gap[at].sum()
        sums[f"tokens_lag{k}"] = at.sum().float()
    return {f"_{PREFIX}{name}": value for name, value in sums.items()}, gap.max() if gap.numel() else gap.sum()


def mismatch_metrics(totals: dict[str, float], largest: float) -> dict[str, float]:
    """The step's figures from the summed totals (the `_mismatch/...` keys are taken out of `totals`)."""
    raw = {key[len(PREFIX) + 1:]: totals.pop(key) for key in [k for k in totals if k.startswith(f"_{PREFIX}")]}
    if not raw:
        return {}
    tokens = max(raw["tokens"], 1.0)
    metrics = {f"{PREFIX}abs_mean": raw["abs"] / tokens, f"{PREFIX}abs_max": largest, f"{PREFIX}k3": raw["k3"] / tokens}
    for k in LAGS:
        name = f"lag{k}" if k < LAGS[-1] else f"lag{k}+"
        if raw[f"tokens_lag{k}"] > 0:
            metrics[f"{PREFIX}abs_mean_{name}"] = raw[f"abs_lag{k}"] / raw[f"tokens_lag{k}"]
    return metrics


def largest_over_ranks(env, value: torch.Tensor) -> float:
    """The largest of every rank's `value` (a scalar tensor); `env` is the trainer's DistEnv."""
    if not env.distributed:
        return float(value)
    on_device = value.to(env.device).reshape(1)
    dist.all_reduce(on_device, op=dist.ReduceOp.MAX)
    return float(on_device.item())


class MismatchTooLarge(RuntimeError):
    """The rollout's logprobs drifted beyond `mismatch.stop_above` from the trainer's."""


def check_mismatch(config: MismatchConfig, metrics: dict[str, float], step: int) -> None:
    """Export the step's figures (Prometheus) and warn or stop as `config` says when one is above its bound."""
    for name, figure in metrics.items():
        if name.startswith(PREFIX):
            MISMATCH.labels(stat=name[len(PREFIX):]).set(figure)
    value = metrics.get(f"{PREFIX}{config.metric}")
    if value is None:
        return
    if config.stop_above is not None and value > config.stop_above:
        raise MismatchTooLarge(f"step {step}: rollout-vs-trainer logprob mismatch {config.metric} = {value:.4g} is "
                               f"above mismatch.stop_above = {config.stop_above:g} (trainer_metrics.jsonl has the "
                               "figures by version lag; a float32 LM head on both sides narrows it)")
    if config.warn_above is not None and value > config.warn_above:
        log.warning("step %d: rollout-vs-trainer logprob mismatch %s = %.4g is above mismatch.warn_above = %g",
                    step, config.metric, value, config.warn_above)
