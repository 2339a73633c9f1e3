"""Checkpoints (model, optimizer, step, weight version, extra state) and Hugging Face export (a mixture-of-experts
model's experts under per-expert names).

A checkpoint is a folder `step_00000042/` holding a torch.distributed.checkpoint (DCP) of the model
and optimizer state, keyed by parameter name: each rank writes its own shards (`__R_0.distcp`) and
`.metadata` maps them onto the whole tensors, so a run resumes on any number of ranks and any (dp,
tp) layout, each rank reading only the slices it needs. state.json holds the step, weight version
and extra state. The folder is written under a temporary name and renamed, then the `latest` file
is replaced atomically: a crash mid-save leaves the previous checkpoint as the latest. Folders of
the format before DCP (rank 0's whole state dicts in model.pt and optimizer.pt) still load.
"""

import dataclasses
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import AutoTokenizer

from trainer.lora import is_adapter, lora_settings, write_adapter_export
from trainer.model import LM_PREFIX, PolicyModel
from trainer.moe.names import per_expert_names
from trainer.parallel import (
    DistEnv,
    gather_model_state,
    load_model_state,
    load_optimizer_state,
    load_sharded_state,
    sharded_state,
)

# DCP warns on every save and load without a process group (a world of one), which is this trainer's plain case.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

MODEL_FILE = "model.pt"  # the format before DCP
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.json"
LATEST_FILE = "latest"
PROCESSOR_FILE = "preprocessor_config.json"  # a vision-language model's image processor (Hugging Face's name)


@dataclass
class TrainState:
    """Where training stands. `extra["unacked_samples"]` (trainer/loop.py) lists, by lease, the samples this
    state was trained on whose ack the buffer has not confirmed: a resumed trainer acks them, never trains them."""

    step: int = 0
    weight_version: int = 0
    samples_trained: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def hf_state_dict(full_state: dict[str, torch.Tensor], tied_embeddings: bool) -> dict[str, torch.Tensor]:
    """The language model's tensors under Hugging Face names (no value head; no tied lm_head copy). A LoRA policy's
    are its wrapped names (`q_proj.base_layer.weight`, `q_proj.lora_A.weight`: trainer/lora.py)."""
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

    With `submit` (rank 0's ordered background calls, trainer.leases.LeaseCalls), rank 0 commits the checkpoint
    (in a world of one: copies the state and writes it too) on that thread, so calls submitted after this one (the
    checkpoint's acks) run only once it is durable. Under torchrun every rank writes its shards before returning
    (the writes are collective); only the commit waits on the thread."""
    root = Path(root)
    final = root / f"step_{state.step:08d}"
    # Rank 0's name on every rank, new at each save: a save of a step saved already (the end of a run) never
    # touches the folder an earlier save's commit, still queued on the background thread, will rename.
    staging = root / env.broadcast_object(f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    state_json = json.dumps(dataclasses.asdict(state), indent=1).encode()
    shards = sharded_state(policy, optimizer)
    if env.distributed:
        if env.is_main:
            _fresh_dir(staging)
        env.barrier()
        dcp.save(shards, checkpoint_id=staging)
        write = partial(_commit, root, final, staging, state_json, keep_last)
    else:
        # The live tensors: the training goes on changing them while the thread writes.
        shards = _copied(shards) if submit is not None else shards
        write = partial(_write_and_commit, shards, root, final, staging, state_json, keep_last)
    if env.is_main:
        write() if submit is None else submit(write)
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


def _fresh_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)


def _write_and_commit(shards: dict, root: Path, final: Path, staging: Path, state_json: bytes, keep_last: int) -> None:
    _fresh_dir(staging)
    dcp.save(shards, checkpoint_id=staging, no_dist=True)
    _commit(root, final, staging, state_json, keep_last)


def _commit(root: Path, final: Path, staging: Path, state_json: bytes, keep_last: int) -> None:
    """Make the written `staging` folder the checkpoint `final` and the latest: durable first, then renamed, then
    named by `latest` (atomically replaced)."""
    if latest_checkpoint(root) == final:  # saved already (at this step, by this run)
        shutil.rmtree(staging)
        return
    _fsync_write(staging / STATE_FILE, state_json)
    for file in staging.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
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
    """Restore model and optimizer from `path`, whatever the world size and layout it was saved with (each rank
    reads the slices of the saved shards its own shards need); collective."""
    path = Path(path)
    if (path / MODEL_FILE).exists():
        return _load_full_checkpoint(path, policy, optimizer, env)
    shards = sharded_state(policy, optimizer)
    dcp.load(shards, checkpoint_id=path, no_dist=not env.distributed)
    load_sharded_state(policy, optimizer, shards)
    return TrainState(**json.loads((path / STATE_FILE).read_text()))


def _load_full_checkpoint(path: Path, policy: PolicyModel, optimizer: torch.optim.Optimizer, env: DistEnv) -> TrainState:
    """The format before DCP (rank 0's full state dicts, model.pt and optimizer.pt): read on rank 0, scattered."""
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


def read_model_state(path: str | Path) -> dict[str, torch.Tensor]:
    """A checkpoint's whole model state dict, read in this process alone (no process group)."""
    path = Path(path)
    if (path / MODEL_FILE).exists():
        return torch.load(path / MODEL_FILE, map_location="cpu", weights_only=True)
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model = {name.removeprefix("model."): torch.empty(meta.size, dtype=meta.properties.dtype)
             for name, meta in saved.items() if name.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    state = {"model": model}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state["model"]


def export_hf(out_dir: str | Path, policy: PolicyModel, tokenizer_dir: str | Path, env: DistEnv) -> Path:
    """Write the policy as a Hugging Face folder (config, model.safetensors, tokenizer); collective. A LoRA policy's
    model.safetensors holds the merged weights (W + scale * B @ A), and `adapter/` the PEFT adapter folder."""
    out_dir = Path(out_dir)
    full_state = gather_model_state(policy, env)
    if env.is_main:
        staging = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        policy.lm.config.save_pretrained(staging)
        tensors = hf_state_dict(full_state, ties_embeddings(policy))
        lora = lora_settings(policy)
        if lora is not None:  # the PEFT adapter folder in staging/adapter, and the merged model
            tensors = write_adapter_export(staging, tensors, *lora, base_model=str(tokenizer_dir))
        _save_tensors(tensors, staging)
        _save_processors(tokenizer_dir, staging)
        shutil.rmtree(out_dir, ignore_errors=True)
        staging.rename(out_dir)
    env.barrier()
    return out_dir


def _save_tensors(tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """model.safetensors of an export: a mixture-of-experts model's experts under per-expert names, as the Hub's
    checkpoints hold them (trainer/moe/names.py)."""
    tensors = per_expert_names(tensors)
    save_file({name: t.contiguous() for name, t in tensors.items()}, folder / "model.safetensors", metadata={"format": "pt"})


def _save_processors(model_dir: str | Path, folder: Path) -> None:
    """The model folder's tokenizer, and a vision-language model's image processor (preprocessor_config.json: the
    rollout reads images with it), into an export."""
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    processor = Path(model_dir) / PROCESSOR_FILE
    if processor.exists():
        shutil.copyfile(processor, folder / PROCESSOR_FILE)


def export_checkpoint_hf(checkpoint: str | Path, model_path: str | Path, out_dir: str | Path,
                         lora: tuple[float, float] | None = None) -> Path:
    """Write a saved checkpoint's policy as a Hugging Face folder: the model folder's config and tokenizer with the
    checkpoint's weights (a trainer stopped at a time budget exports this way, from its latest checkpoint). A LoRA
    checkpoint's needs `lora` = (alpha, dropout): merged weights, and the PEFT adapter folder in `adapter/`."""
    from transformers import AutoConfig

    out_dir = Path(out_dir)
    config = AutoConfig.from_pretrained(model_path)
    full_state = read_model_state(checkpoint)
    tensors = hf_state_dict(full_state, bool(getattr(config, "tie_word_embeddings", False)))
    staging = out_dir.with_name(f".tmp-{out_dir.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if any(is_adapter(name) for name in tensors):
        if lora is None:
            raise ValueError(f"{checkpoint}: a LoRA checkpoint: give its (alpha, dropout) to merge it")
        tensors = write_adapter_export(staging, tensors, *lora, base_model=str(model_path))
    config.save_pretrained(staging)
    _save_tensors(tensors, staging)
    _save_processors(model_path, staging)
    shutil.rmtree(out_dir, ignore_errors=True)
    staging.rename(out_dir)
    return out_dir
