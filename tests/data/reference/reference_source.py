"""Reading and running the reference source: verl's and TRL's functions, executed as they stand.

The source is read at a given commit with `git show` (any clone or bare mirror), the functions needed are
extracted with `ast` (decorators dropped) and executed in a namespace holding torch and the few objects they
expect; verl's config objects and DataProto.batch are stood in for by the small shims below. Used by
generate.py and generate_pipeline.py.
"""

import ast
import math
import subprocess
import types
from collections import defaultdict
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F


def git_show(repo: str, commit: str, path: str) -> str:
    return subprocess.run(["git", "-C", repo, "show", f"{commit}:{path}"], capture_output=True, text=True, check=True).stdout


def resolve(repo: str, commit: str) -> str:
    return subprocess.run(["git", "-C", repo, "rev-parse", commit], capture_output=True, text=True, check=True).stdout.strip()


def extract(source: str, names: set[str]) -> str:
    """The top-level functions, classes and assignments named in `names`, decorators dropped."""
    tree = ast.parse(source)
    kept = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names:
            node.decorator_list = []
            kept.append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id in names for t in targets):
                kept.append(node)
    missing = names - {getattr(n, "name", None) for n in kept} - {
        t.id for n in kept if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)
    }  # fmt: skip
    if missing:
        raise SystemExit(f"not found in the reference source: {sorted(missing)}")
    return ast.unparse(ast.Module(body=kept, type_ignores=[]))


def run(code: str, namespace: dict[str, Any]) -> types.SimpleNamespace:
    exec(compile(code, "<reference>", "exec"), namespace)  # noqa: S102 -- the reference's own source, on purpose
    return types.SimpleNamespace(**namespace)


class ActorConfig(dict):
    """Stands in for verl's ActorConfig: attribute and .get access, no global batch info (one micro-batch, dp 1)."""

    __getattr__ = dict.__getitem__

    @property
    def global_batch_info(self) -> dict:
        return {}


class AlgoConfig(dict):
    __getattr__ = dict.__getitem__


class Batch(dict):
    """Stands in for DataProto.batch (a TensorDict): item access and batch_size."""

    @property
    def batch_size(self):
        return [next(iter(self.values())).shape[0]]


def load_verl(repo: str, commit: str) -> types.SimpleNamespace:
    common = {"torch": torch, "np": np, "math": math, "Optional": Optional, "Any": Any, "defaultdict": defaultdict}
    tf = run(
        extract(git_show(repo, commit, "verl/utils/torch_functional.py"),
                {"masked_sum", "masked_mean", "masked_var", "masked_whiten", "clip_by_value"}),
        dict(common),
    )  # fmt: skip
    verl_F = types.SimpleNamespace(**{k: getattr(tf, k) for k in ("masked_sum", "masked_mean", "masked_var", "masked_whiten", "clip_by_value")})
    core = run(
        extract(git_show(repo, commit, "verl/trainer/ppo/core_algos.py"), {
            "compute_gae_advantage_return", "compute_grpo_outcome_advantage", "agg_loss", "compute_policy_loss_vanilla",
            "compute_policy_loss_gspo", "compute_value_loss", "kl_penalty", "kl_penalty_forward", "FixedKLController",
            "AdaptiveKLController", "compute_policy_loss_cispo", "compute_policy_loss_sapo", "compute_policy_loss_reinforce",
            "compute_rloo_outcome_advantage", "compute_reinforce_plus_plus_outcome_advantage",
            "compute_reinforce_plus_plus_baseline_outcome_advantage",
        }),
        {**common, "verl_F": verl_F, "ActorConfig": ActorConfig, "AlgoConfig": AlgoConfig, "DictConfig": dict},
    )  # fmt: skip
    corr = run(
        extract(git_show(repo, commit, "verl/trainer/ppo/rollout_corr_helper.py"), {
            "SAFETY_BOUND", "SUPPORTED_ROLLOUT_RS_OPTIONS", "TOKEN_LEVEL_ROLLOUT_RS_OPTIONS", "_parse_rollout_rs_thresholds",
            "compute_rollout_rejection_mask", "compute_rs_metrics", "compute_rollout_correction_weights", "compute_is_metrics",
        }),
        {**common, "verl_F": verl_F},
    )  # fmt: skip
    trainer = run(
        extract(git_show(repo, commit, "verl/trainer/ppo/ray_trainer.py"), {"apply_kl_penalty"}),
        {**common, "core_algos": core, "masked_mean": verl_F.masked_mean, "DataProto": object},
    )
    return types.SimpleNamespace(core=core, corr=corr, apply_kl_penalty=trainer.apply_kl_penalty)


def load_trl_dpo_losses(repo: str, commit: str):
    """A function running the loss section of DPOTrainer._compute_loss (log-ratios, f-divergence scores, the
    loss-type loop) as it stands in the source, for one loss type."""
    tree = ast.parse(git_show(repo, commit, "trl/trainer/dpo_trainer.py"))
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DPOTrainer")
    method = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "_compute_loss")
    start = next(i for i, n in enumerate(method.body) if "chosen_logratios" in ast.unparse(n).split("=")[0])
    stop = next(i for i, n in enumerate(method.body) if isinstance(n, ast.For) and "loss_type" in ast.unparse(n.target))
    code = ast.unparse(ast.Module(body=method.body[start : stop + 1], type_ignores=[]))

    def losses(loss_type, beta, chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, completion_mask):
        self = types.SimpleNamespace(
            beta=beta, loss_types=[loss_type], loss_weights=[1.0], label_smoothing=0.0, use_weighting=False,
            f_divergence_type="reverse_kl", f_alpha_divergence_coef=1.0,
        )  # fmt: skip
        namespace = {
            "torch": torch, "F": F, "self": self, "device": "cpu", "chosen_logps": chosen_logps,
            "rejected_logps": rejected_logps, "ref_chosen_logps": ref_chosen_logps,
            "ref_rejected_logps": ref_rejected_logps, "completion_mask": completion_mask,
        }  # fmt: skip
        exec(compile(code, "<trl>", "exec"), namespace)  # noqa: S102 -- the reference's own source, on purpose
        return namespace["per_sequence_loss"]

    return losses
