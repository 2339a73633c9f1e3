"""Tensor + sequence parallelism over the "tp" mesh for the Hugging Face decoders (Qwen2, Qwen3, Llama).

Megatron's layout, in torch.distributed.tensor.parallel styles: inside each decoder layer the
attention projections q/k/v and the MLP's gate/up are split by output (column-wise: each rank
holds whole heads), o_proj and down_proj by input (row-wise), so one layer costs one all-gather
and one reduce-scatter per block. Between those blocks the residual stream and the RMSNorms run
sequence-parallel: each rank holds T / tp positions. The embedding is split by vocabulary row and
all-reduced (its output stays whole: the model computes positions and the causal mask from it),
the first layer takes its share of positions, the final norm ends sequence-parallel and the LM
head is split by vocabulary: trainer/lm_head.py computes each rank's share of every chunk's logits and
sums the softmax statistics over the group (no rank holds the whole [B, T, V]). PPO's value head is
small and computed whole on every rank of the group.

Sequence parallelism needs T divisible by tp: rows are right-padded to it before the forward
(padding is masked and causal attention never looks right, so real positions are unchanged) and
the outputs cut back after it (and handed out as plain tensors).

With pipeline stages (trainer/parallel/stages.py) the plan applies to what the rank's stages hold: the embedding
and the first layer's input split only on the first stage, the final norm and the heads only on the last; a stage
hands the next one its share of positions as its last layer left them, and trainer/parallel/pipeline.py pads the
micro-batches to a width tp divides instead of pad_sequences.
"""

import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.lora import LoraLinear
from trainer.model import PolicyModel


def check_tp(config, tp: int) -> None:
    """ValueError unless whole heads split over `tp` ranks (K/V heads too: each rank keeps its query heads' K/V),
    and the model is dense (the plan splits an MLP's gate/up/down projections, which a mixture-of-experts layer
    lacks)."""
    if getattr(config, "num_experts", 0) or getattr(config, "n_routed_experts", 0):
        raise ValueError(f"parallel.tp={tp}: tensor parallelism does not split a mixture-of-experts model's experts "
                         f"yet ({config.model_type}); use parallel.tp 1 with parallel.ep (experts split over the "
                         "data-parallel ranks)")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, field)
        if value % tp:
            raise ValueError(f"parallel.tp={tp} does not divide the model's {field}={value}")


def apply_tp(policy: PolicyModel, mesh: DeviceMesh) -> None:
    """Split the policy's decoder over `mesh` (the "tp" dimension) in place."""
    lm = policy.lm
    check_tp(lm.config, mesh.size())
    # The styles re-create each parameter they split as a trainable one: frozen ones (a LoRA base, a reference
    # policy) are frozen again below, before FSDP copies the flag into its shards.
    frozen = {name for name, parameter in policy.named_parameters() if not parameter.requires_grad}
    base, head = lm.base_model, lm.get_output_embeddings()
    tied = head is not None and base.embed_tokens is not None and head.weight is base.embed_tokens.weight
    parallelize_module(base, mesh, _outer_plan(base))
    layers = base.layers.values() if isinstance(base.layers, nn.ModuleDict) else base.layers
    for layer in layers:
        parallelize_module(layer, mesh, _layer_plan(layer, mesh.size()))
    # The head's weight split by vocabulary row; the policy's forward uses it directly (trainer/lm_head.py:
    # head_token_stats), never calling the module, so these input/output layouts only describe it.
    if head is not None:
        parallelize_module(head, mesh,
                           ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=False))
    if tied:  # both split by vocabulary row (Shard(0)): one parameter again
        lm.get_output_embeddings().weight = lm.get_input_embeddings().weight
    if policy.value_head is not None:
        distribute_module(policy.value_head, mesh, input_fn=_gather_sequence, output_fn=_copy)
    for name, parameter in policy.named_parameters():
        if name in frozen:
            parameter.requires_grad_(False)


def _outer_plan(base: nn.Module) -> dict:
    """The embedding (whole output), the first layer taking its share of positions, the final norm; a pipeline
    stage (trainer/parallel/stages.py) holds some of them: the first layer of a later stage receives the previous
    stage's share of positions as it left its last layer."""
    plan = {}
    if base.embed_tokens is not None:
        plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        plan["layers.0"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)
    if base.norm is not None:
        plan["norm"] = SequenceParallel()
    return plan


def _layer_plan(layer: nn.Module, tp: int) -> dict:
    plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                        desired_input_kwarg_layouts={"hidden_states": Replicate()}),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }  # fmt: skip
    plan = _follow_adapters(layer, plan, tp)
    # Qwen3's per-head q/k norms see this rank's heads only; their weight (one per head dim) is replicated and
    # its gradient summed over the group. The "sequence" layout only marks the tensor as split, elementwise.
    for norm in ("q_norm", "k_norm"):
        if hasattr(layer.self_attn, norm):
            plan[f"self_attn.{norm}"] = SequenceParallel(use_local_output=True)
    return plan


def _follow_adapters(layer: nn.Module, plan: dict, tp: int) -> dict:
    """A LoRA-wrapped projection (trainer/lora.py, peft's names) is split as its base_layer; its adapter so that the
    update lands as the base's output does (rank % tp == 0). Column-wise: A by its rank rows, its output all-gathered,
    then B by output rows. Row-wise: A by input columns, its output reduce-scattered over the rank, then B by its rank
    columns, reduce-scattered over the sequence as the base's output is."""
    followed = {}
    for name, style in plan.items():
        module = layer.get_submodule(name)
        if not isinstance(module, LoraLinear):
            followed[name] = style
            continue
        if module.lora_A.out_features % tp:
            raise ValueError(f"model.lora.rank={module.lora_A.out_features} must be a multiple of parallel.tp")
        followed[f"{name}.base_layer"] = style
        if isinstance(style, ColwiseParallel):
            followed[f"{name}.lora_A"] = ColwiseParallel(output_layouts=Replicate())
            followed[f"{name}.lora_B"] = ColwiseParallel()
        else:
            followed[f"{name}.lora_A"] = RowwiseParallel(output_layouts=Shard(-1))
            followed[f"{name}.lora_B"] = RowwiseParallel(input_layouts=Shard(-1), output_layouts=Shard(1))
    return followed


def _gather_sequence(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    hidden, *rest = inputs
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, (Shard(1),), run_check=False)
    return (hidden.redistribute(mesh, (Replicate(),)), *rest)


def _copy(_module: nn.Module, output: DTensor, _mesh: DeviceMesh) -> DTensor:
    # A DTensor linear over [B, T, H] returns a view; [B, T, 1] costs nothing to copy, and FSDP's root hook
    # warns of views (an in-place op on one would skip its pre-backward hook).
    return output.clone()


def pad_sequences(policy: PolicyModel, multiple: int) -> None:
    """Right-pad every forward's (input_ids, attention_mask, and the per-position inverse temperatures) to a
    multiple of `multiple` positions (masked), and return (logprobs, entropy, values) as plain tensors cut back to
    the length given. Registered after FSDP's hooks. Packed rows (position ids) are refused by the config."""
    lengths: list[int] = []

    def pad(_module: nn.Module, args: tuple) -> tuple:
        input_ids, attention_mask, *rest = args
        length = input_ids.shape[1]
        lengths.append(length)
        extra = -length % multiple
        if len(rest) > 1 and rest[1] is not None:  # inverse temperatures, one per predicting position
            rest[1] = F.pad(rest[1], (0, extra), value=1.0)
        return (F.pad(input_ids, (0, extra)), F.pad(attention_mask, (0, extra)), *rest)

    def cut(_module: nn.Module, _args: tuple, outputs: tuple) -> tuple:
        length = lengths.pop()
        logprobs, entropy, values = outputs
        return (logprobs[:, : length - 1], None if entropy is None else entropy[:, : length - 1],
                None if values is None else values.to_local()[:, :length])

    policy.register_forward_pre_hook(pad)
    policy.register_forward_hook(cut)
