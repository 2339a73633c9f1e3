"""Checkpoints (model, optimizer, step, weight version, extra state) and Hugging Face export.

A checkpoint is a folder `step_00000042/` holding model.pt and optimizer.pt (full, unsharded
state dicts keyed by parameter name, so a run resumes on any number of ranks) and state.json.
It is written under a temporary name and renamed, then the `latest` file is replaced
atomically: a crash mid-save leaves the previous checkpoint as the latest.
"""

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from trainer.model import LM_PREFIX, PolicyModel
from trainer.parallel import (
    DistEnv,
    gather_model_state,
    gather_optimizer_state,
    load_model_state,
    load_optimizer_state,
)

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.json"
LATEST_FILE = "latest"


@dataclass
class TrainState:
    """Where training stands. `extra["unacked_samples"]` (trainer/loop.py) lists, by lease, the samples this
    state was trained on whose ack the buffer has not confirmed: a resumed trainer acks them, never trains them."""

    step: int = 0
    weight_version: int = 0
    samples_trained: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def hf_state_dict(full_state: dict[str, torch.Tensor], tied_embeddings: bool) -> dict[str, torch.Tensor]:
    """The language model's tensors under Hugging Face names (no value head; no tied lm_head copy)."""
    lm_state = {name.removeprefix(LM_PREFIX): t for name, t in full_state.items() if name.startswith(LM_PREFIX)}
    if tied_embeddings:
        lm_state.pop("lm_head.weight", None)
    return lm_state


def ties_embeddings(policy: PolicyModel) -> bool:
    return bool(getattr(policy.lm.config, "tie_word_embeddings", False))


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save(obj: Any, path: Path) -> None:
    torch.save(obj, path)
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(
    root: str | Path,
    policy: PolicyModel,
    optimizer: torch.optim.Optimizer,
    state: TrainState,
    env: DistEnv,
    keep_last: int = 2,
    submit: Callable[[Callable[[], None]], None] | None = None,
) -> Path:
    """Save a checkpoint of `state.step` under `root`; collective (every rank calls it).

    With `submit` (rank 0's ordered background calls, trainer.leases.LeaseCalls), rank 0 copies the state and
    writes the files on that thread: the step does not wait for the disk, and calls submitted after this one (the
    checkpoint's acks) run only once it is durable."""
    root = Path(root)
    final = root / f"step_{state.step:08d}"
    model_state = gather_model_state(policy, env)
    optimizer_state = gather_optimizer_state(policy, optimizer, env)
    if env.is_main:
        state_json = json.dumps(dataclasses.asdict(state), indent=1).encode()
        if submit is None:
            _write_checkpoint(root, final, model_state, optimizer_state, state_json, keep_last)
        else:
            # gather_model_state returns copies already; one process's optimizer state is the live one.
            optimizer_copy = _copied(optimizer_state)
            submit(lambda: _write_checkpoint(root, final, model_state, optimizer_copy, state_json, keep_last))
    env.barrier()
    return final


def _copied(value: Any) -> Any:
    """`value` with every tensor in it cloned (a state dict the training goes on changing)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(item) for item in value)
    return value


def _write_checkpoint(root: Path, final: Path, model_state: dict, optimizer_state: dict, state_json: bytes,
                      keep_last: int) -> None:
    if latest_checkpoint(root) == final:  # saved already (at this step, by this run)
        return
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    _torch_save(model_state, staging / MODEL_FILE)
    _torch_save(optimizer_state, staging / OPTIMIZER_FILE)
    _fsync_write(staging / STATE_FILE, state_json)
    _fsync_dir(staging)
    # A folder of this step that `latest` does not name is a crashed run's, which never became the latest
    # (and whose acks never went out): this run's state replaces it.
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    _fsync_write(root / f".{LATEST_FILE}.tmp", final.name.encode())
    os.replace(root / f".{LATEST_FILE}.tmp", root / LATEST_FILE)
    _fsync_dir(root)
    _prune(root, keep_last)


def _prune(root: Path, keep_last: int) -> None:
    for old in sorted(root.glob("step_*"))[:-keep_last]:
        shutil.rmtree(old)


def latest_checkpoint(root: str | Path | None) -> Path | None:
    """The folder the `latest` file names, or None when there is no checkpoint yet."""
    if root is None or not (Path(root) / LATEST_FILE).exists():
        return None
    path = Path(root) / (Path(root) / LATEST_FILE).read_text().strip()
    if not (path / STATE_FILE).exists():
        raise FileNotFoundError(f"checkpoint {path} named by {Path(root) / LATEST_FILE} is incomplete or missing")
    return path


def load_checkpoint(path: str | Path, policy: PolicyModel, optimizer: torch.optim.Optimizer, env: DistEnv) -> TrainState:
    """Restore model and optimizer from `path` (read on rank 0, scattered to all); collective."""
    path = Path(path)
    model_state: dict[str, Any] = {}
    optimizer_state: dict[str, Any] = {}
    state = None
    if env.is_main:
        model_state = torch.load(path / MODEL_FILE, map_location="cpu", weights_only=True)
        optimizer_state = torch.load(path / OPTIMIZER_FILE, map_location="cpu", weights_only=True)
        state = TrainState(**json.loads((path / STATE_FILE).read_text()))
    load_model_state(policy, model_state, env)
    load_optimizer_state(policy, optimizer, optimizer_state, env)
    return env.broadcast_object(state)


def export_hf(out_dir: str | Path, policy: PolicyModel, tokenizer_dir: str | Path, env: DistEnv) -> Path:
    """Write the policy as a Hugging Face folder (config, model.safetensors, tokenizer); collective."""
    out_dir = Path(out_dir)
    full_state = gather_model_state(policy, env)
    if env.is_main:
        staging = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        policy.lm.config.save_pretrained(staging)
        tensors = hf_state_dict(full_state, ties_embeddings(policy))
        save_file({name: t.contiguous() for name, t in tensors.items()}, staging / "model.safetensors", metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(staging)
        shutil.rmtree(out_dir, ignore_errors=True)
        staging.rename(out_dir)
    env.barrier()
    return out_dir


def export_checkpoint_hf(checkpoint: str | Path, model_path: str | Path, out_dir: str | Path) -> Path:
    """Write a saved checkpoint's policy as a Hugging Face folder: the model folder's config and tokenizer with the
    checkpoint's weights (a trainer stopped at a time budget exports this way, from its latest checkpoint)."""
    from transformers import AutoConfig

    out_dir = Path(out_dir)
    config = AutoConfig.from_pretrained(model_path)
    full_state = torch.load(Path(checkpoint) / MODEL_FILE, map_location="cpu", weights_only=True)
    tensors = hf_state_dict(full_state, bool(getattr(config, "tie_word_embeddings", False)))
    staging = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    config.save_pretrained(staging)
    save_file({name: t.contiguous() for name, t in tensors.items()}, staging / "model.safetensors", metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(model_path).save_pretrained(staging)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir
