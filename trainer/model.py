"""The policy: a Hugging Face causal LM, optionally with a value head, and its per-token logprobs."""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from trainer.losses import entropy_from_logits

# Names of the value head's parameters in the policy's state dict (never exported to HF).
VALUE_HEAD_PREFIX = "value_head."
LM_PREFIX = "lm."


class PolicyModel(nn.Module):
    """A causal LM (`lm`) plus an optional scalar value head on its last hidden state (PPO's critic)."""

    def __init__(self, lm: nn.Module, value_head: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.value_head: nn.Linear | None = None
        if value_head:
            self.value_head = nn.Linear(lm.config.hidden_size, 1)
            # A zero critic: the first advantages are the plain returns, the same on every rank.
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The transformer blocks (the units FSDP shards one by one)."""
        return self.lm.base_model.layers

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [B, T, V], values [B, T, 1] or None). No views out: FSDP2 hooks the outputs."""
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm.get_output_embeddings()(hidden)
        values = self.value_head(hidden) if self.value_head is not None else None
        return logits, values


def load_policy(path: str | Path, *, value_head: bool = False, device: torch.device | str = "cpu") -> PolicyModel:
    """Load an HF folder as float32 parameters (autocast handles bf16 compute), dropout off.

    Dropout stays off (eval mode) during training too: the trainer's logprobs must be the
    numbers the rollout engine reports for the same weights.
    """
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy = PolicyModel(lm, value_head=value_head).to(device)
    policy.eval()
    return policy


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Logprob of each next token, [B, T-1]: log_softmax of `logits` (already divided by the sampling
    temperature), gathered at the token. The same number the rollout engine reports for a sampled token.
    """
    log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@dataclass
class PolicyOutput:
    """Per-token outputs aligned to next-token columns ([B, T-1])."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    values: torch.Tensor | None


def run_policy(
    model: PolicyModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    entropy_grad: bool = False,
) -> PolicyOutput:
    """Forward pass: logprobs of the next tokens, entropy (with gradient only if asked), values.

    Logprobs and entropy are of softmax(logits / T) with each row's sampling temperature T
    (`temperatures` [B], None = 1): the distribution the rollout drew the tokens from and reported
    logprobs of (rollout/engine/sampler.py, logprobs_mode "tempered"), as verl divides its logits too.
    """
    logits, values = model(input_ids, attention_mask)
    if temperatures is not None and bool((temperatures != 1.0).any()):
        logits = logits / temperatures.to(logits.device, logits.dtype)[:, None, None]
    logprobs = token_logprobs(logits, input_ids)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logits(logits[:, :-1])
    return PolicyOutput(logprobs, entropy, values[:, :-1, 0].float() if values is not None else None)
