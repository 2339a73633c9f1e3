"""What a LoRA policy publishes (trainer/lora.py), and whether a step's publish goes out at all.

AdapterWeights: the base model under Hugging Face names, gathered and cast once (it is frozen), then every adapter,
gathered at each publish: `<module>.lora_A.weight` and `<module>.lora_B.weight`, B pre-scaled by alpha / rank, so a
receiver serves W + B @ A (rollout/serve/adapter_merge.py). The broadcaster (`adapter`: trainer/broadcast/adapter.py)
sends the base once and then the adapter buckets alone.

AdapterGate: a publish is skipped when no rank's adapter moved by more than `publish.adapter_min_change` since the
last one. Each rank compares its own shards, then the ranks take the largest verdict together (an all-reduce), so
every rank skips or none does: a rank that went on alone would wait in the publish's gathers forever.
"""

import torch
from torch.distributed.tensor import DTensor

from trainer.checkpoint import hf_state_dict, ties_embeddings
from trainer.lora import LORA_B, adapter_state, hf_base_names, is_adapter, lora_modules
from trainer.model import PolicyModel
from trainer.parallel import DistEnv


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a shard (collective for a DTensor: every rank calls it, in the same order)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


class AdapterWeights:
    """publish tensors of a LoRA policy (collective; rank 0 gets them, the others an empty mapping)."""

    def __init__(self, policy: PolicyModel, env: DistEnv, dtype: torch.dtype | None) -> None:
        self.policy, self.env, self.dtype = policy, env, dtype
        self.scale = lora_modules(policy)[0][1].scale
        self._tied = ties_embeddings(policy)
        self._base: dict[str, torch.Tensor] | None = None

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if self.dtype is not None and tensor.is_floating_point() else tensor

    @torch.no_grad()
    def __call__(self) -> dict[str, torch.Tensor]:
        state = hf_state_dict(self.policy.state_dict(), self._tied)
        if self._base is None:
            base = {name: self._cast(_whole(t).detach()) for name, t in hf_base_names(state).items()}
            self._base = base if self.env.is_main else {}
        adapters = {}
        for name, tensor in adapter_state(state).items():
            whole = _whole(tensor).detach().float()
            whole = whole * self.scale if f".{LORA_B}." in name else whole.clone()  # a copy: the optimizer moves it
            adapters[name] = self._cast(whole)
        return {**self._base, **adapters} if self.env.is_main else {}


class AdapterGate:
    """Whether the adapters moved by more than `min_change` (largest absolute change of any element) since the last
    publish, on any rank; collective. The first call is always True."""

    def __init__(self, policy: PolicyModel, env: DistEnv, min_change: float) -> None:
        self.env, self.min_change = env, min_change
        self._parameters = [p for name, p in policy.named_parameters() if is_adapter(name)]
        self._last: list[torch.Tensor] | None = None

    @torch.no_grad()
    def moved(self) -> bool:
        local = [p.to_local() if isinstance(p, DTensor) else p for p in self._parameters]
        changed = self._last is None or any(
            bool(((now - then).abs() > self.min_change).any()) for now, then in zip(local, self._last, strict=True))
        changed = bool(self.env.all_reduce_max(int(changed)))
        if changed:
            self._last = [t.detach().clone() for t in local]
        return changed
