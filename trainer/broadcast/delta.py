"""Delta sync (`delta: auto`): the trainer keeps the base, the bytes of the last version every receiver took, bucket
by bucket as the publish lays them out (the cast the engines serve), and encodes the next version against it.

A publish is partial (base_version set, only the changed words travel: services/weights/delta.py) when every receiver
took the base and said it applies partial updates (the broadcaster keeps that record); otherwise whole, with the
checksums still checked. A version sent whole although a base existed counts in `fallbacks`: a receiver missed the
base, failed the last version (a checksum mismatch included), or answered needs_full (it restarted).
"""

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from services.weights import Manifest, allocate_staging, pack_bucket
from services.weights.delta import WHOLE, BucketPart, encode_bucket, wire_manifest, word_dtype


@dataclass
class Outgoing:
    """One version as it goes out: its parts, and what is broadcast for them (the wire manifest and tensors)."""

    base_version: int  # 0: the whole version
    parts: tuple[BucketPart, ...]
    manifest: Manifest
    tensors: dict[str, torch.Tensor]

    @property
    def bytes(self) -> int:
        return self.manifest.total_bytes


class DeltaEncoder:
    """The base and the next version, packed into two sets of buckets that swap roles once a version is taken."""

    def __init__(self) -> None:
        self.base_version: int | None = None
        self.fallbacks = 0
        self._manifest: Manifest | None = None
        self._base: list[torch.Tensor] | None = None
        self._current: list[torch.Tensor] | None = None

    @torch.no_grad()
    def encode(self, manifest: Manifest, tensors: Mapping[str, torch.Tensor], partial: bool | None
               ) -> tuple[Outgoing, Outgoing]:
        """Pack `tensors` as the next version; (the partial form, the whole form). The partial form is the whole one
        when there is no base, or `partial` is not True: False, a receiver lacks the base (a fallback); None, one
        cannot apply partial updates (an old or a new receiver)."""
        device = next(iter(tensors.values())).device
        if self._manifest != manifest or self._current is None or self._current[0].device != device:
            self._manifest, self._base, self.base_version = manifest, None, None
            self._current = allocate_staging(manifest, device)
        for index in range(len(manifest.bucket_sizes)):
            pack_bucket(manifest, index, tensors, out=self._current[index])
        if not partial or self.base_version is None or self._base is None:
            if partial is False and self.base_version is not None:
                self.fallbacks += 1
            whole = self._outgoing(manifest, None, 0)
            return whole, whole
        outgoing = self._outgoing(manifest, self._base, self.base_version)
        parts = tuple(BucketPart(p.bucket, WHOLE, manifest.bucket_sizes[p.bucket], checksum=p.checksum)
                      for p in outgoing.parts)
        whole = Outgoing(0, parts, wire_manifest(parts), {f"part.{i}": t for i, t in enumerate(self._current) if t.numel()})
        return outgoing, whole

    def taken(self, version: int) -> None:
        """Receivers switched to the version last encoded: it is the base of the next."""
        self._base, self._current = self._current, self._base
        if self._current is None:
            self._current = allocate_staging(self._manifest, self._base[0].device)
        self.base_version = version

    def fell_back(self) -> None:
        """A receiver answered needs_full to a partial version: it goes whole."""
        self.fallbacks += 1

    def _outgoing(self, manifest: Manifest, base: list[torch.Tensor] | None, base_version: int) -> Outgoing:
        parts, wire = [], {}
        for index, current in enumerate(self._current):
            part, data = encode_bucket(index, current, None if base is None else base[index],
                                       word_dtype(manifest, index))
            parts.append(part)
            if data is not None:
                wire[f"part.{index}"] = data
        return Outgoing(base_version, tuple(parts), wire_manifest(parts), wire)
