"""Routing replay (R3): the trainer's MoE layers run the experts the rollout engine routed each token to.

A transformers MoE layer (5.25: Qwen3MoeSparseMoeBlock) asks its router (Qwen3MoeTopKRouter) for
(logits, scores, indices) over the layer's tokens, flattened [batch * sequence], and runs its experts
(Qwen3MoeExperts) on `indices` weighted by `scores`. A forward hook on each router replaces, under replay,
the indices by the rollout's and the scores by the router's own softmax probabilities gathered at them
(renormalised over the top-k when the model's norm_topk_prob says so, as the router itself does): the
experts are the rollout's, the gates stay the router's function of its weight, so the router keeps
learning (its weight gets a gradient through the gates). A token without a rollout route (-1: the last
response token, which no rollout forward saw; padding) keeps the router's own choice.

The hooks also keep, from the last forward, each layer's logits and own top-k (the metrics read them:
router agreement, expert load, the load-balancing loss; trainer/moe/metrics.py).
"""

import functools
from collections.abc import Sequence

import torch
from torch import nn

from protos.sample import Sample


def is_router(module: nn.Module) -> bool:
    """A transformers top-k router (Qwen3MoeTopKRouter and its kin return logits, scores, indices)."""
    return type(module).__name__.endswith("TopKRouter")


class RouterHooks:
    """Forward hooks on every router of `lm`, in layer order (the order of the rollout's route layers)."""

    def __init__(self, lm: nn.Module):
        self.routers = [module for module in lm.modules() if is_router(module)]
        self.num_experts = self.routers[0].weight.shape[0] if self.routers else 0
        self.top_k = self.routers[0].top_k if self.routers else 0
        self.replay: torch.Tensor | None = None  # [tokens, layers, top_k] int64 for the next forwards; -1: own
        self.routes: torch.Tensor | None = None  # the rollout's routes of the last forward's tokens (replayed or not)
        self.tokens: torch.Tensor | None = None  # [tokens] bool: the last forward's tokens that count (not padding)
        self.logits: list[torch.Tensor | None] = [None] * len(self.routers)  # [tokens, experts], with grad
        self.own: list[torch.Tensor | None] = [None] * len(self.routers)  # the router's own top-k [tokens, top_k]
        self.used: list[torch.Tensor | None] = [None] * len(self.routers)  # the experts the layer ran
        self.gates: list[torch.Tensor | None] = [None] * len(self.routers)  # and their weights (detached)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(functools.partial(self._hook, layer))

    def prepare(self, routes: torch.Tensor | None, tokens: torch.Tensor, replay: bool) -> None:
        """Before a forward: the rollout's `routes` of its tokens ([tokens, layers, top_k], the forward's [batch,
        sequence] flattened row by row; -1 where none; None when the batch carries none), which of them count
        (`tokens`, for the metrics), and whether to replay the routes. They hold for the forwards from now on, until
        the next call (an activation-checkpointed backward recomputes with the same routes)."""
        if routes is not None and routes.shape[1:] != (len(self.routers), self.top_k):
            raise ValueError(f"routed_experts: {list(routes.shape[1:])} routes per token, but the policy has "
                             f"{len(self.routers)} sparse layers of top {self.top_k}")
        if replay and routes is None:
            raise ValueError("moe.routing_replay: rollout, but the batch carries no routed_experts (a dense rollout "
                             "model, or an engine that records none: vLLM, SGLang)")
        self.routes = routes.long() if routes is not None else None
        self.tokens = tokens
        self.replay = self.routes if replay else None

    def _hook(self, layer: int, module: nn.Module, args, output):
        logits, scores, own = output
        self.logits[layer], self.own[layer] = logits, own.detach()
        if self.replay is None:
            self.used[layer], self.gates[layer] = own.detach(), scores.detach()
            return None
        if self.replay.shape[0] != logits.shape[0]:
            raise ValueError(f"routed_experts: routes for {self.replay.shape[0]} tokens, the forward has "
                             f"{logits.shape[0]}")
        wanted = self.replay[:, layer].to(own.device)
        indices = torch.where(wanted >= 0, wanted, own)
        gates = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, indices)
        if module.norm_topk_prob:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        gates = gates.to(logits.dtype)
        self.used[layer], self.gates[layer] = indices, gates.detach()
        return logits, gates, indices


def router_hooks(lm: nn.Module) -> RouterHooks | None:
    """Hooks on `lm`'s routers; None for a dense model."""
    hooks = RouterHooks(lm)
    return hooks if hooks.routers else None


def check_routes(samples: Sequence[Sample]) -> None:
    """Under replay every sample must carry its routes: a ValueError names the first that does not (R3 that
    silently replays nothing trains as if it were off)."""
    for sample in samples:
        if not sample.routed_experts.shape[0]:
            raise ValueError(f"moe.routing_replay: rollout, but sample {sample.sample_id} carries no routed_experts "
                             "(its rollout model is dense, or its engine records no routes: only the native engine "
                             "does; vLLM and SGLang do not)")
