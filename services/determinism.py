"""Deterministic runs (`deterministic: true` in an experiment file, deploy/experiment/schema.py): what every process of one
sets in torch, and the order a batch's samples are trained in.

A run is reproducible when nothing in it depends on timing: each completion is sampled from a seed derived from
the run's seed and its place in the prompt stream (rollout/driver/driver.py), the rollout computes each step's
groups as one batch with nothing beside it, the buffer and the trainer put a batch's samples in one canonical
order, and every torch kernel is a deterministic one with a fixed number of threads (this module).
"""

import os


def use_deterministic_torch(threads: int | None = 1) -> None:
    """Deterministic kernels only (an op without one raises rather than vary), cuDNN without autotuning, cuBLAS with
    its fixed workspace, and `threads` intra-op threads (None: leave torch's count, fixed for a machine)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any CUDA work
    import torch

    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    if threads is not None:
        torch.set_num_threads(threads)


def canonical_key(group_id: str, sample_id: str) -> tuple[str, str]:
    """Where a sample goes in a batch of a deterministic run: by group, then by sample (ids are the driver's
    `{prompt_id}#{producer}.{group index}/{completion index}`, one producer per run)."""
    return group_id, sample_id
