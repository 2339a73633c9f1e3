"""Expert parallelism over "ep", a split of the data-parallel dimension: each MoE layer's experts divided among the
ranks of an expert group, the tokens sent to the rank holding their expert and back, by all-to-all.

The mesh lends its "dp" ranks: dp = edp x ep (trainer/parallel/mesh.py unflattens "dp" into ("edp", "ep"); dp rank
= edp_rank * ep + ep_rank, so one expert group is ep neighbouring data-parallel ranks). No mesh dimension is added:
every rank still trains its own share of the batch, and every parameter but the experts is FSDP-sharded over all of
"dp" as before. A transformers experts module (Qwen3MoeExperts: `gate_up_proj` [E, 2I, H], `down_proj` [E, H, I])
holds, on ep rank j, experts j * E/ep .. (j + 1) * E/ep - 1: its two parameters become DTensors split by expert
(Shard(0)) over "ep", so their names and global shapes stay the whole model's (checkpoints, the publish and DCP see
the unsharded layout). FSDP then shards them over "edp" only (trainer/parallel/fsdp.py), the ranks holding the same
experts, and sums their gradients there.

The experts' forward (torchtitan's and Megatron's token dispatcher, in its plainest form): each (token, slot) of the
router's top-k goes to the rank of its expert, sorted by expert; every rank runs its experts on what it received, one
matmul pair per expert, and sends the outputs back; the sender multiplies them by the gates and sums each token's k,
as Qwen3MoeExperts does unsharded, so the router's gates (and routing replay's, trainer/moe/routing.py) apply
unchanged. The all-to-alls are autograd functions: their backward sends the gradients back the same way.

Gradient scale: each rank's loss is its share of the global sum times dp (trainer/learner.py), and an expert's
gradient on its rank already sums the tokens of its whole expert group; FSDP's reduction over "edp" divides by dp
(set_gradient_divide_factor), not by the edp ranks it sums over, so the expert gradients are the sum over the batch,
as every other parameter's.
"""

import functools
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The fused experts modules of `model` (transformers' Qwen3MoeExperts and kin: one [E, ...] tensor per
    projection), in layer order."""
    return [module for module in model.modules()
            if type(module).__name__.endswith("Experts") and all(hasattr(module, name) for name in EXPERT_PARAMS)]


def check_ep(model: nn.Module, ep: int) -> None:
    """ValueError unless `model` is a mixture-of-experts model whose experts split evenly over `ep` ranks."""
    experts = expert_modules(model)
    if not experts:
        raise ValueError(f"parallel.ep={ep}: the model has no experts modules (a dense model); use parallel.ep 1")
    count = experts[0].num_experts
    if count % ep:
        raise ValueError(f"parallel.ep={ep} does not divide the model's num_experts={count}")


def apply_ep(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split every experts module of `model` over `mesh` (the "ep" dimension) in place: its parameters by expert,
    its forward dispatching tokens to the experts' ranks. Works on the meta device."""
    check_ep(model, mesh.size())
    for module in expert_modules(model):
        for name in EXPERT_PARAMS:
            parameter = getattr(module, name)
            split = nn.Parameter(distribute_tensor(parameter.data, mesh, [Shard(0)]),
                                 requires_grad=parameter.requires_grad)
            setattr(module, name, split)
        module.forward = functools.partial(_dispatched_forward, module, mesh)


def _dispatched_forward(module: nn.Module, mesh: DeviceMesh, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    """Qwen3MoeExperts.forward with the experts spread over `mesh`: [N, H] hidden states, the router's top-k experts
    and gates [N, k] of each token, to the [N, H] gated sum of its experts' outputs."""
    group = mesh.get_group()
    ep = mesh.size()
    gate_up, down = (_local(getattr(module, name)) for name in EXPERT_PARAMS)
    local = gate_up.shape[0]
    top_k = top_k_index.shape[1]
    experts = top_k_index.reshape(-1)
    order = torch.argsort(experts, stable=True)  # (token, slot) pairs by expert, so by destination rank
    tokens = order // top_k
    # How many pairs this rank sends each rank's each expert, and receives for its own from each rank.
    sent = torch.bincount(experts, minlength=ep * local).view(ep, local)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    send_splits, receive_splits = sent.sum(1).tolist(), received.sum(1).tolist()
    inputs = all_to_all_single_autograd(hidden_states[tokens], receive_splits, send_splits, group)
    # What arrived is, from each rank in turn, sorted by expert: run each expert on its rows.
    arrived = torch.arange(local, device=experts.device).repeat(ep).repeat_interleave(received.flatten())
    by_expert = torch.argsort(arrived, stable=True)
    counts = torch.bincount(arrived, minlength=local).tolist()
    outputs = [_expert(module, gate_up[e], down[e], rows)
               for e, rows in enumerate(inputs[by_expert].split(counts)) if counts[e]]
    # No rows for any of this rank's experts: a zero gradient all the same, so every rank of "edp" reduces one.
    computed = torch.cat(outputs) if outputs else inputs[:0] + 0 * (gate_up.sum() + down.sum())
    computed = computed[torch.argsort(by_expert)]  # back to the order they arrived in
    returned = all_to_all_single_autograd(computed, send_splits, receive_splits, group)
    gated = returned * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(hidden_states).index_add(0, tokens, gated.to(hidden_states.dtype))


def _expert(module: nn.Module, gate_up: torch.Tensor, down: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    gate, up = nn.functional.linear(rows, gate_up).chunk(2, dim=-1)
    return nn.functional.linear(module.act_fn(gate) * up, down)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float) -> float:
    """torch's clip_grad_norm_ (the 2-norm over every gradient, whole), also when the gradients are DTensors on
    several meshes (expert parallelism: the experts' on ("edp", "ep"), the rest on "dp"), which one norm of them all
    cannot mix: each mesh's norm is taken whole, then combined."""
    groups: dict[DeviceMesh | None, list[nn.Parameter]] = {}
    for parameter in parameters:
        if parameter.grad is not None:
            mesh = parameter.grad.device_mesh if isinstance(parameter.grad, DTensor) else None
            groups.setdefault(mesh, []).append(parameter)
    if len(groups) <= 1:
        return float(_whole(nn.utils.clip_grad_norm_(next(iter(groups.values()), []), max_norm)))
    norms = [_whole(nn.utils.get_total_norm([parameter.grad for parameter in group])) for group in groups.values()]
    total = torch.linalg.vector_norm(torch.stack(norms))
    for group in groups.values():
        nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return float(total)


def _whole(norm: torch.Tensor) -> torch.Tensor:
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
