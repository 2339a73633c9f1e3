"""Pipeline stages: the policy split at decoder-layer boundaries, each rank holding its stages' layers only.

Stage s of S holds a run of consecutive decoder layers (balanced by count, or `parallel.pp_split`); the first also
the token embedding, the last the final norm, the LM head (run chunk by chunk, trainer/lm_head.py) and PPO's value
head. Rank r of the "pp" mesh dimension holds stages r, r + pp, ... (one with 1F1B, `pp_virtual_stages` when
interleaved: torch.distributed.pipelining's loop layout).

Each rank's policy is the whole model's PolicyModel pruned to its stages (the other layers gone, `layers` a
ModuleDict keyed by the global layer index, embedding / head None where not held), so its parameter names are the
whole model's ("lm.model.layers.5.mlp.up_proj.weight"): checkpoints (DCP, keyed by name) resume on any split, and
the optimizer, publishing and export see the usual names. A `PolicyStage` is the runnable module of one stage,
holding the same submodules; TP (over "tp", trainer/parallel/tp.py, on the pruned policy), then activation
checkpointing and FSDP (over "dp") apply per stage, FSDP's root unit the stage's embedding / norm / heads.
"""

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from trainer.config.parallel import ParallelConfig
from trainer.lm_head import head_token_stats
from trainer.parallel.fsdp import mixed_precision_policy, uses_fsdp
from trainer.parallel.mesh import DistEnv


def stage_layers(num_layers: int, config: ParallelConfig) -> list[range]:
    """The global layer indices of every stage, in order."""
    stages = config.stages()
    counts = config.pp_split
    if counts is None:
        if num_layers < stages:
            raise ValueError(f"parallel.pp: {stages} stages need at least as many decoder layers, the model has "
                             f"{num_layers}")
        counts = [num_layers // stages + (s < num_layers % stages) for s in range(stages)]
    if sum(counts) != num_layers:
        raise ValueError(f"parallel.pp_split {counts} sums to {sum(counts)}, the model has {num_layers} layers")
    starts = [sum(counts[:s]) for s in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def local_stage_ids(env: DistEnv, config: ParallelConfig) -> list[int]:
    """This rank's stages (the loop layout of torch.distributed.pipelining's multi-stage schedules)."""
    return list(range(env.pp_rank, config.stages(), env.pp_size))


class PolicyStage(nn.Module):
    """One stage's forward: token ids (first stage) or the previous stage's hidden states in; hidden states out,
    or from the last stage (logprobs [B, T-1], entropy [B, T-1] if asked, values [B, T, 1] with a value head).
    Every stage gets the micro-batch's input ids and attention mask as keyword arguments: each builds its own
    causal mask and rotary embeddings, and the last scores the next tokens."""

    def __init__(self, lm: nn.Module, value_head: nn.Module | None, layers: range, first: bool, last: bool,
                 chunk_tokens: int, lm_head_fp32: bool) -> None:
        super().__init__()
        base = lm.base_model
        self.config = lm.config
        self.first, self.last = first, last
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): base.layers[str(i)] for i in layers})
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.head = lm.get_output_embeddings() if last else None
        self.value_head = value_head if last else None
        self.chunk_tokens, self.lm_head_fp32 = chunk_tokens, lm_head_fp32
        self.entropy = True  # set per schedule run (trainer/parallel/pipeline.py)

    def forward(self, hidden: torch.Tensor, *, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                inv_temperatures: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        if self.first:
            hidden = self.embed_tokens(hidden)
        # Under TP a later stage receives its share of positions (sequence parallel): the mask and rotary embeddings
        # are the whole sequence's, as the first stage makes them (the masks read the query length off the embeds).
        width = input_ids.shape[1]
        position_ids = torch.arange(width, device=hidden.device)[None]
        embeds = hidden if hidden.shape[1] == width else hidden[:, :1].expand(-1, width, -1)
        mask_kwargs = {"config": self.config, "inputs_embeds": embeds, "attention_mask": attention_mask,
                       "cache": None, "position_ids": position_ids}
        masks = {"full_attention": create_causal_mask(**mask_kwargs)}
        if "sliding_attention" in self.config.layer_types:
            masks["sliding_attention"] = create_sliding_window_causal_mask(**mask_kwargs)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for index, layer in self.layers.items():
            hidden = layer(hidden, attention_mask=masks[self.config.layer_types[int(index)]],
                           position_embeddings=position_embeddings, position_ids=position_ids, use_cache=False)
        if not self.last:
            return hidden
        hidden = self.norm(hidden)
        logprobs, entropies = head_token_stats(hidden, self.head, input_ids, inv_temperatures,
                                               chunk_tokens=self.chunk_tokens, fp32=self.lm_head_fp32,
                                               entropy=self.entropy)
        outputs = [logprobs] + ([entropies] if self.entropy else [])
        if self.value_head is not None:
            values = self.value_head(hidden)
            outputs.append(values.to_local() if isinstance(values, DTensor) else values)  # TP: replicated, whole
        return tuple(outputs)


def split_stages(policy: nn.Module, env: DistEnv, config: ParallelConfig) -> None:
    """Prune `policy` (a PolicyModel, on the meta device) in place to this rank's stages and attach them as
    `policy.pipeline_stages` (a plain list: the stages are no submodules, so no name is doubled)."""
    lm = policy.lm
    if getattr(lm.config, "tie_word_embeddings", False):
        raise ValueError("parallel.pp > 1: the model ties its embedding and LM head, which sit on the first and the "
                         "last stage; not supported yet")
    ranges = stage_layers(lm.config.num_hidden_layers, config)
    mine = local_stage_ids(env, config)
    base = lm.base_model
    base.layers = nn.ModuleDict({str(i): base.layers[i] for s in mine for i in ranges[s]})
    first, last = 0 in mine, config.stages() - 1 in mine
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = None
        lm.lm_head = None
        policy.value_head = None
    policy.pipeline_stages = [
        PolicyStage(lm, policy.value_head, ranges[s], s == 0, s == config.stages() - 1, policy.chunk_tokens,
                    policy.lm_head_fp32)
        for s in mine
    ]
    policy.pipeline_stage_ids = mine


def shard_stages(policy: nn.Module, env: DistEnv, config: ParallelConfig, dtype: str, checkpointing: bool) -> None:
    """Per stage, in compose.py's order: activation checkpointing of each layer, then FSDP over "dp" (each layer
    a unit, the stage the root) when there is more than one data-parallel rank (fsdp.uses_fsdp)."""
    mp_policy = mixed_precision_policy(dtype, env.device, config.mixed_precision)
    dp_mesh = env.mesh["dp"]
    for stage in policy.pipeline_stages:
        if checkpointing:
            from torch.distributed._composable import checkpoint

            for layer in stage.layers.values():
                checkpoint(layer, preserve_rng_state=False)  # dropout is off: no random state to replay
        if not uses_fsdp(env):
            continue
        for layer in stage.layers.values():
            fully_shard(layer, mesh=dp_mesh, mp_policy=mp_policy)
        fully_shard(stage, mesh=dp_mesh, mp_policy=mp_policy)
