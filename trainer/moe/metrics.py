"""What a mixture-of-experts policy's routers did in a step: agreement with the rollout, expert load, and the
load-balancing loss (trainer_metrics.jsonl's moe/* figures, also on TensorBoard, Prometheus's relayrl_trainer_moe and `relayrl
status`; docs/moe.md).

- moe/router_agreement: of the (token, sparse layer) pairs the rollout routed, the share whose top-k set the
  trainer's own router picks too, taken from the router's own top-k whether or not the step replays the rollout's
  (with R3 the experts run are the rollout's; this says how far the routers would stray without it).
- moe/load_max_over_mean/L: in sparse layer L, the most tokens any expert got over the mean per expert (1 =
  balanced), by the router's own top-k over the step's tokens; moe/load_max_over_mean: the worst layer's.
- moe/aux_loss: Switch Transformer's load-balancing loss, per layer E / (N k) * sum_e count_e * P_e (count_e the
  top-k slots given to expert e among the N tokens, the experts the layer ran; P_e its mean router probability),
  averaged over the layers: 1 when balanced. Taken per micro-batch (so it depends on how the batch is split);
  moe.aux_loss_coef times its mean over micro-batches and ranks joins the loss.
"""

import torch
from prometheus_client import Gauge

from trainer.moe.routing import RouterHooks

MOE = Gauge("relayrl_trainer_moe", "A mixture-of-experts policy's routers in the last step: router_agreement (with the "
            "rollout), load_max_over_mean (the worst layer's), aux_loss", ["stat"])


class MoeStats:
    """Sums over a step's micro-batches (`add` after each training forward), reduced over ranks by `finish`."""

    def __init__(self, hooks: RouterHooks):
        self.hooks = hooks
        layers, experts = len(hooks.routers), hooks.num_experts
        self.load = torch.zeros(layers, experts, dtype=torch.float64)
        self.agree = torch.zeros(2, dtype=torch.float64)  # pairs agreeing, pairs the rollout routed
        self.aux = torch.zeros(2, dtype=torch.float64)  # aux loss x tokens, tokens

    def add(self) -> torch.Tensor:
        """Count the last forward; returns its load-balancing loss (with gradient into the routers)."""
        hooks = self.hooks
        tokens = hooks.tokens
        count = int(tokens.sum())
        losses = []
        for layer in range(len(hooks.routers)):
            own = hooks.own[layer][tokens]
            self.load[layer] += torch.bincount(own.flatten(), minlength=hooks.num_experts).double().cpu()
            if hooks.routes is not None:
                rollout = hooks.routes[:, layer][tokens]
                routed = (rollout >= 0).all(-1)
                same = (own[routed].sort(-1).values == rollout[routed].sort(-1).values).all(-1)
                self.agree += torch.stack([same.sum(), routed.sum()]).double().cpu()
            losses.append(_switch_loss(hooks.logits[layer][tokens], hooks.used[layer][tokens], hooks.num_experts))
        loss = torch.stack(losses).mean()
        self.aux += torch.tensor([float(loss.detach()) * count, count], dtype=torch.float64)
        return loss

    def finish(self, env) -> dict[str, float]:
        """The step's moe/* metrics, summed over every rank (a collective: every rank calls it)."""
        totals = env.all_reduce_sum(torch.cat([self.agree, self.aux, self.load.flatten()]))
        agree, aux, load = totals[:2], totals[2:4], totals[4:].view_as(self.load)
        imbalance = load.amax(-1) / load.mean(-1).clamp_min(1e-12)
        metrics = {"moe/aux_loss": float(aux[0] / aux[1].clamp_min(1)),
                   "moe/load_max_over_mean": float(imbalance.max())}
        metrics.update({f"moe/load_max_over_mean/{layer}": float(value) for layer, value in enumerate(imbalance)})
        if agree[1] > 0:
            metrics["moe/router_agreement"] = float(agree[0] / agree[1])
        for name in ("router_agreement", "load_max_over_mean", "aux_loss"):
            if f"moe/{name}" in metrics:
                MOE.labels(stat=name).set(metrics[f"moe/{name}"])
        return metrics


def _switch_loss(logits: torch.Tensor, used: torch.Tensor, experts: int) -> torch.Tensor:
    """E / (N k) * sum_e count_e * P_e of N tokens' router logits [N, E] and the experts they ran [N, k]."""
    if logits.shape[0] == 0:
        return logits.sum() * 0.0
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).mean(0)
    share = torch.bincount(used.flatten(), minlength=experts).to(probs.dtype) / used.numel()
    return experts * (share * probs).sum()
