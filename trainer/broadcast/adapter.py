"""Adapter-only publish (a LoRA policy: trainer/lora.py): the base model goes once, then each version is its adapters
alone, a partial update on the version every receiver took (services/weights/delta.py, docs/architecture.md).

The published tensors are the frozen base under Hugging Face names, then every adapter (`<module>.lora_A.weight`,
`<module>.lora_B.weight`, B pre-scaled by alpha / rank): merge_order keeps the adapters' modules after the base's, so
they fill the last buckets. A bucket without an adapter never changes: its checksum is taken once (the whole form
carries it), and after the base is taken it travels as UNCHANGED, unchecked (the receiver copies it from the base it
checked when the base came: hashing the whole base at every version would cost more than the adapter's transfer). A bucket with adapters is encoded against its bytes of the base version
(whole, or the changed words when the bucket also holds base tensors): the trainer keeps two copies of those
buckets only. The whole form (no base, or a receiver lacks it) is the plain layout: every bucket whole.
"""

from collections.abc import Mapping

import torch

from services.weights import Manifest, pack_bucket
from services.weights.delta import (
    UNCHANGED,
    WHOLE,
    BucketPart,
    bucket_checksum,
    encode_bucket,
    wire_manifest,
    word_dtype,
)
from trainer.broadcast.delta import Outgoing
from trainer.lora import is_adapter


class AdapterEncoder:
    """DeltaEncoder's interface (trainer/broadcast/delta.py) for a frozen base plus adapters."""

    def __init__(self) -> None:
        self.base_version: int | None = None
        self.fallbacks = 0
        self._manifest: Manifest | None = None
        self._frozen: dict[int, int] = {}  # bucket -> checksum, for the buckets without adapters
        self._base: dict[int, torch.Tensor] = {}  # adapter buckets as the base version holds them
        self._current: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def encode(self, manifest: Manifest, tensors: Mapping[str, torch.Tensor], partial: bool | None
               ) -> tuple[Outgoing, Outgoing]:
        """(the partial form, the whole form) of the next version; see DeltaEncoder.encode for `partial`."""
        if self._manifest != manifest:
            self._reset(manifest, tensors)
        for index in self._current:
            pack_bucket(manifest, index, tensors, out=self._current[index])
        checksums = {**self._frozen, **{index: bucket_checksum(bucket) for index, bucket in self._current.items()}}
        count = len(manifest.bucket_sizes)
        whole_parts = tuple(BucketPart(i, WHOLE, manifest.bucket_sizes[i], checksum=checksums[i]) for i in range(count))
        whole = Outgoing(0, whole_parts, manifest, dict(tensors))  # the same bytes as every part whole
        if not partial or self.base_version is None:
            if partial is False and self.base_version is not None:
                self.fallbacks += 1
            return whole, whole
        parts, wire = [], {}
        for index in range(count):
            if index in self._frozen:  # unchecked: the receiver copies it from its base, checked when it came
                parts.append(BucketPart(index, UNCHANGED, 0))
                continue
            part, data = encode_bucket(index, self._current[index], self._base[index], word_dtype(manifest, index))
            parts.append(part)
            if data is not None:
                wire[f"part.{index}"] = data
        return Outgoing(self.base_version, tuple(parts), wire_manifest(parts), wire), whole

    def taken(self, version: int) -> None:
        """Receivers switched to the version last encoded: its adapter buckets are the base of the next."""
        self._base, self._current = self._current, self._base
        if not self._current:
            self._current = {index: torch.empty_like(bucket) for index, bucket in self._base.items()}
        self.base_version = version

    def fell_back(self) -> None:
        self.fallbacks += 1

    def _reset(self, manifest: Manifest, tensors: Mapping[str, torch.Tensor]) -> None:
        """A new layout: no base; the frozen buckets' checksums, packed once, one bucket at a time."""
        self._manifest, self.base_version, self._base = manifest, None, {}
        adapters = {index for index, slots in enumerate(manifest.by_bucket) if any(is_adapter(s.name) for s in slots)}
        if not adapters:
            raise ValueError("adapter publish: the tensors hold no adapter (names ending lora_A.weight / lora_B.weight)")
        device = next(iter(tensors.values())).device
        self._current = {index: torch.empty(manifest.bucket_sizes[index], dtype=torch.uint8, device=device)
                         for index in sorted(adapters)}
        scratch = torch.empty(max(manifest.bucket_sizes), dtype=torch.uint8, device=device)
        self._frozen = {index: bucket_checksum(pack_bucket(manifest, index, tensors, out=scratch))
                        for index in range(len(manifest.bucket_sizes)) if index not in adapters}
