"""The policy: a Hugging Face causal LM, optionally with a value head, and its per-token logprobs."""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from trainer.lm_head import head_token_stats
from trainer.moe.routing import router_hooks
from trainer.packing import pack_rows
from trainer.vision import VisionInputs, embed_images, rope_positions

# Names of the value head's parameters in the policy's state dict (never exported to HF).
VALUE_HEAD_PREFIX = "value_head."
LM_PREFIX = "lm."


class PolicyModel(nn.Module):
    """A causal LM (`lm`) plus an optional scalar value head on its last hidden state (PPO's critic).

    Its forward returns per-token logprobs and entropy, never the [B, T, V] logits: the head runs chunk by chunk
    (trainer/lm_head.py), `chunk_tokens` at a time, in float32 when `lm_head_fp32`.
    """

    def __init__(self, lm: nn.Module, value_head: bool = False, chunk_tokens: int = 1024,
                 lm_head_fp32: bool = False) -> None:
        super().__init__()
        self.lm = lm
        self.chunk_tokens, self.lm_head_fp32 = chunk_tokens, lm_head_fp32
        self.vision: VisionInputs | None = None  # a vision-language policy's image arguments (load_policy sets it)
        self.value_head: nn.Linear | None = None
        if value_head:
            self.value_head = nn.Linear(lm.config.hidden_size, 1)
            # A zero critic: the first advantages are the plain returns, the same on every rank.
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)
        # A mixture-of-experts LM's routers, hooked for routing replay and their metrics (trainer/moe/); None: dense
        self.router_hooks = router_hooks(lm)

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """The transformer blocks (the units FSDP shards one by one): a vision-language model's are its decoder's."""
        base = self.lm.base_model
        return base.layers if hasattr(base, "layers") else base.language_model.layers

    @property
    def vision_blocks(self) -> nn.ModuleList:
        """A vision-language model's vision tower blocks (FSDP units too); empty for a text model."""
        visual = getattr(self.lm.base_model, "visual", None)
        return visual.blocks if visual is not None else nn.ModuleList()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        inv_temperatures: torch.Tensor | None = None,
        entropy: bool = True,
        **attention_kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(logprobs [B, T-1] of the next tokens, their entropy [B, T-1] or None, values [B, T, 1] or None).

        `inv_temperatures` [B, T-1]: 1 / the temperature of each predicting position (None = 1). The head is used
        inside this forward, so FSDP2 has it unsharded. No views out: FSDP2 hooks the outputs.
        """
        inputs = {"input_ids": input_ids}
        if "pixel_values" in attention_kwargs:  # a vision-language policy's images (trainer/vision.py)
            images = {key: attention_kwargs.pop(key) for key in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
            inputs = {"inputs_embeds": embed_images(self.lm.base_model, input_ids, **images)}
            if position_ids is None:  # padded rows (packed ones bring theirs: VisionInputs.packed)
                position_ids = rope_positions(self.lm.base_model, input_ids, attention_mask, images["image_grid_thw"],
                                              images["mm_token_type_ids"])
        # No KV cache: it would hold every layer's keys and values, and with one transformers ignores packed rows.
        hidden = self.lm.base_model(**inputs, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False, **attention_kwargs).last_hidden_state
        logprobs, entropies = head_token_stats(hidden, self.lm.get_output_embeddings(), input_ids, inv_temperatures,
                                               chunk_tokens=self.chunk_tokens, fp32=self.lm_head_fp32, entropy=entropy)
        values = self.value_head(hidden) if self.value_head is not None else None
        return logprobs, entropies, values


def load_policy(path: str | Path, *, value_head: bool = False, device: torch.device | str = "cpu",
                chunk_tokens: int = 1024, lm_head_fp32: bool = False) -> PolicyModel:
    """Load an HF folder as float32 parameters (autocast handles bf16 compute), dropout off.

    Dropout stays off (eval mode) during training too: the trainer's logprobs must be the
    numbers the rollout engine reports for the same weights.
    """
    lm = auto_class(path).from_pretrained(path, dtype=torch.float32)
    policy = PolicyModel(lm, value_head=value_head, chunk_tokens=chunk_tokens, lm_head_fp32=lm_head_fp32).to(device)
    policy.vision = VisionInputs.for_model(path)
    policy.eval()
    return policy


def auto_class(path: str | Path):
    """transformers' auto class of the folder's model: a vision-language model (config.json has a vision tower) loads
    with its vision tower (AutoModelForImageTextToText), others as causal LMs."""
    config = Path(path) / "config.json"
    if config.exists() and "vision_config" in json.loads(config.read_text()):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def checkpoint_layers(model: PolicyModel) -> None:
    """Activation checkpointing: each decoder layer keeps only its inputs and recomputes the rest in the backward.

    torch's composable checkpoint (hooks, as `fully_shard` is): parameter names stay what they were, so state
    dicts, checkpoints and weight publishing are unchanged; it composes with FSDP2 applied after it."""
    from torch.distributed._composable import checkpoint

    for layer in model.decoder_layers:
        checkpoint(layer, preserve_rng_state=False)  # dropout is off: no random state to replay


@dataclass
class PolicyOutput:
    """Per-token outputs aligned to next-token columns ([B, T-1])."""

    logprobs: torch.Tensor
    entropy: torch.Tensor | None
    values: torch.Tensor | None


@dataclass
class Packing:
    """Run the forward on packed rows (trainer/packing.py): `row_tokens` per row (None = one row)."""

    row_tokens: int | None = None
    pad_id: int = 0


def run_policy(
    model: PolicyModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperatures: torch.Tensor | None = None,
    entropy_grad: bool = False,
    *,
    packing: Packing | None = None,
    entropy: bool = True,
    routes: torch.Tensor | None = None,
    replay: bool = False,
    token_mask: torch.Tensor | None = None,
    images: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> PolicyOutput:
    """Forward pass: logprobs of the next tokens, entropy (with gradient only if asked; None if not `entropy`),
    values, in the padded layout of `input_ids` (right-padded rows) whether or not the forward ran packed. `images`:
    the rows' (pixel_values, image_grids) of a vision-language policy (TrainBatch.images), packed or not.

    Logprobs and entropy are of softmax(logits / T) with each row's sampling temperature T
    (`temperatures` [B], None = 1): the distribution the rollout drew the tokens from and reported
    logprobs of (rollout/engine/sampler.py, logprobs_mode "tempered"), as verl divides its logits too.

    A mixture-of-experts model learns the rollout's `routes` of the input tokens ([B, T, layers, top_k], -1 where
    none) and replays them with `replay` (trainer/moe/routing.py); `token_mask` [B, T] (default attention_mask) says
    which tokens its routing metrics count.
    """
    hooks = model.router_hooks
    tokens = attention_mask if token_mask is None else token_mask
    if images is not None and model.vision is None:
        raise ValueError("images: the policy has no image processor (load it with load_policy)")
    inv = None
    if temperatures is not None and bool((temperatures != 1.0).any()):
        inv = 1.0 / temperatures.to(input_ids.device, torch.float32)
    if packing is None:
        inv_tokens = inv[:, None].expand(-1, input_ids.shape[1] - 1) if inv is not None else None
        if hooks is not None:
            flat = routes.reshape(-1, *routes.shape[2:]).to(input_ids.device) if routes is not None else None
            hooks.prepare(flat, tokens.reshape(-1).bool(), replay)
        vision = model.vision.from_batch(*images, input_ids) if images is not None else {}
        logprobs, entropies, values = model(input_ids, attention_mask, None, inv_tokens, entropy, **vision)
        values = values[:, :-1, 0].float() if values is not None else None
    else:
        rows = pack_rows(input_ids, attention_mask.sum(-1).tolist(), packing.row_tokens, packing.pad_id)
        vision = {} if images is None else model.vision.packed(model.lm.base_model, rows, *images, input_ids,
                                                               attention_mask)
        position_ids = vision.pop("position_ids", rows.position_ids)
        if hooks is not None:
            hooks.prepare(rows.pack_tokens(routes.to(input_ids.device), -1) if routes is not None else None,
                          rows.pack_tokens(tokens, 0).bool(), replay)
        logprobs, entropies, values = model(rows.input_ids, None, position_ids,
                                            rows.spread(inv) if inv is not None else None, entropy,
                                            **rows.attention_kwargs(), **vision)
        logprobs = rows.unpack(logprobs)
        entropies = rows.unpack(entropies) if entropies is not None else None
        values = rows.unpack(values[:, :-1, 0].float()) if values is not None else None
    if entropies is not None and not (entropy_grad and torch.is_grad_enabled()):
        entropies = entropies.detach()
    return PolicyOutput(logprobs, entropies, values)
