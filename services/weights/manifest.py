"""The manifest of a weight update: which tensor travels in which bucket, at which byte offset."""

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from protos import common_pb2, weights_pb2
from protos.codec import CodecError

# Offsets are aligned so a bucket slice can be viewed as any dtype (and sits on a cache line).
ALIGN_BYTES = 64

TORCH_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: common_pb2.DTYPE_FLOAT32,
    torch.float16: common_pb2.DTYPE_FLOAT16,
    torch.bfloat16: common_pb2.DTYPE_BFLOAT16,
    torch.float64: common_pb2.DTYPE_FLOAT64,
    torch.int32: common_pb2.DTYPE_INT32,
    torch.int64: common_pb2.DTYPE_INT64,
    torch.uint8: common_pb2.DTYPE_UINT8,
}
WIRE_TO_TORCH: dict[int, torch.dtype] = {code: dtype for dtype, code in TORCH_TO_WIRE.items()}


def aligned(offset: int) -> int:
    """`offset` rounded up to ALIGN_BYTES."""
    return -(-offset // ALIGN_BYTES) * ALIGN_BYTES


@dataclass(frozen=True)
class TensorSlot:
    """Where one named tensor lives in the bucket stream."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Manifest:
    """Every tensor of an update and the byte size of each bucket, in broadcast order."""

    slots: tuple[TensorSlot, ...]
    bucket_sizes: tuple[int, ...]
    by_bucket: tuple[tuple[TensorSlot, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        groups: list[list[TensorSlot]] = [[] for _ in self.bucket_sizes]
        for slot in self.slots:
            groups[slot.bucket].append(slot)
        object.__setattr__(self, "by_bucket", tuple(tuple(group) for group in groups))

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """name -> (shape, dtype): what a receiver checks against its own parameters."""
        return {slot.name: (slot.shape, slot.dtype) for slot in self.slots}

    def to_proto(self) -> tuple[list[weights_pb2.TensorSpec], list[int]]:
        """(tensors, bucket_sizes) for a BeginUpdateRequest."""
        specs = [
            weights_pb2.TensorSpec(name=s.name, shape=s.shape, dtype=TORCH_TO_WIRE[s.dtype], bucket=s.bucket,
                                   offset=s.offset)
            for s in self.slots
        ]
        return specs, list(self.bucket_sizes)

    @classmethod
    def from_proto(cls, specs: Sequence[weights_pb2.TensorSpec], bucket_sizes: Sequence[int]) -> "Manifest":
        """Rebuild and validate a manifest from the wire; CodecError names the offending tensor."""
        if not specs:
            raise CodecError("tensors: the manifest is empty")
        slots, seen = [], set()
        for spec in specs:
            where = f"tensor {spec.name!r}"
            if not spec.name or spec.name in seen:
                raise CodecError(f"{where}: names must be non-empty and unique")
            seen.add(spec.name)
            if spec.dtype not in WIRE_TO_TORCH:
                raise CodecError(f"{where}: unsupported dtype code {spec.dtype}")
            if any(dim < 0 for dim in spec.shape):
                raise CodecError(f"{where}: negative dimension in shape {list(spec.shape)}")
            if spec.bucket >= len(bucket_sizes):
                raise CodecError(f"{where}: bucket {spec.bucket} but only {len(bucket_sizes)} buckets")
            slot = TensorSlot(spec.name, tuple(spec.shape), WIRE_TO_TORCH[spec.dtype], spec.bucket, spec.offset)
            if slot.offset % ALIGN_BYTES or slot.offset + slot.nbytes > bucket_sizes[slot.bucket]:
                raise CodecError(
                    f"{where}: bytes [{slot.offset}, {slot.offset + slot.nbytes}) are not an aligned range "
                    f"inside bucket {slot.bucket} of {bucket_sizes[slot.bucket]} bytes"
                )
            slots.append(slot)
        manifest = cls(tuple(slots), tuple(int(size) for size in bucket_sizes))
        for index, group in enumerate(manifest.by_bucket):
            ordered = sorted(group, key=lambda s: s.offset)
            for before, after in itertools.pairwise(ordered):
                if before.offset + before.nbytes > after.offset:
                    raise CodecError(f"tensor {after.name!r}: overlaps {before.name!r} in bucket {index}")
        return manifest


TensorLayout = Mapping[str, torch.Tensor] | Iterable[tuple[str, Sequence[int], torch.dtype]]


# Projections that engines merge into one matrix (the native engine and vLLM: qkv_proj, gate_up_proj),
# in merge order.
MERGED_PROJECTIONS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_MERGE_RANK = {part: (group, rank) for group, parts in enumerate(MERGED_PROJECTIONS) for rank, part in enumerate(parts)}


def merge_order(tensors: Iterable[tuple[str, Sequence[int], torch.dtype]]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The (name, shape, dtype) triples reordered so that merged projections travel back to back.

    Names are `<module>.<part>.<kind>`. Modules keep their order; within one, weights come before
    biases, and the parts of a merged projection (MERGED_PROJECTIONS) follow each other in merge order
    where the first of them was. Qwen2 checkpoints interleave q.weight, q.bias, k.weight, ... and
    safetensors files sort names (k_proj before q_proj); in this order a receiving engine that merges
    q/k/v and gate/up serves the staged bytes without a copy.
    """
    triples = [(name, tuple(shape), dtype) for name, shape, dtype in tensors]
    module_seen: dict[str, int] = {}
    group_seen: dict[tuple[str, bool, int], int] = {}
    keys = []
    for index, (name, _, _) in enumerate(triples):
        module, part, kind = (["", *name.rsplit(".", 2)])[-3:]
        is_bias = kind == "bias"
        module_index = module_seen.setdefault(module, index)
        if part in _MERGE_RANK:
            group, rank = _MERGE_RANK[part]
            keys.append((module_index, is_bias, group_seen.setdefault((module, is_bias, group), index), rank))
        else:
            keys.append((module_index, is_bias, index, 0))
    return [triple for _, triple in sorted(zip(keys, triples, strict=True), key=lambda pair: pair[0])]


def plan_buckets(tensors: TensorLayout, bucket_bytes: int, solo_bytes: int | None = None,
                 group: Callable[[str], object] | None = None) -> Manifest:
    """Lay tensors out, in order, into buckets of at most `bucket_bytes`.

    `tensors` is a name -> tensor mapping or (name, shape, dtype) triples. A tensor of `solo_bytes`
    or more (default: `bucket_bytes`) gets a bucket of its own: tensors are never split, and a bucket
    holding one tensor is broadcast straight from that tensor's memory, with no packing copy. `group`: a new
    bucket starts wherever group(name) changes (a LoRA publish keeps its adapters out of the base's buckets).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    solo_bytes = bucket_bytes if solo_bytes is None else solo_bytes
    if isinstance(tensors, Mapping):
        triples = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    else:
        triples = [(name, tuple(shape), dtype) for name, shape, dtype in tensors]
    slots: list[TensorSlot] = []
    sizes: list[int] = []
    can_join = False  # whether the last bucket takes more tensors (not after a solo tensor)
    last_group = None
    for name, shape, dtype in triples:
        if group is not None:
            can_join = can_join and group(name) == last_group
            last_group = group(name)
        if dtype not in TORCH_TO_WIRE:
            raise ValueError(f"tensor {name!r}: dtype {dtype} cannot be broadcast")
        nbytes = TensorSlot(name, shape, dtype, bucket=0, offset=0).nbytes
        alone = nbytes >= solo_bytes
        offset = aligned(sizes[-1]) if can_join else 0
        if alone or not can_join or offset + nbytes > bucket_bytes:
            sizes.append(0)
            offset = 0
        slots.append(TensorSlot(name, shape, dtype, len(sizes) - 1, offset))
        sizes[-1] = offset + nbytes
        can_join = not alone
    return Manifest(tuple(slots), tuple(sizes))
