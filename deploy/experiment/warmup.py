"""The supervised warm-up that gives RL a policy with some signal, before the RL phase starts from its output.

    samples (a prompt and the answer to learn, loss on the answer) -> SFT steps through the training loop RL uses
    -> the policy written as a Hugging Face folder (what the rollout serves and the trainer trains)

An experiment warms up on its data's (prompt, answer) pairs (deploy/runs/experiment_run.py; the quickstart's: the
addition table), or with `env` on transcripts played in code (deploy/runs/agentic.py).
"""

import pathlib


def sft_sample(prompt_id: str, prompt_ids: list[int], answer_ids: list[int]):
    """One SFT sample (protos.sample.Sample) of `prompt_id`: the loss on every answer token (its EOS included)."""
    import numpy as np

    from protos.sample import Sample

    n = len(answer_ids)
    return Sample(
        sample_id=f"sft/{prompt_id}", prompt_id=prompt_id,
        prompt_ids=np.asarray(prompt_ids, np.int32), response_ids=np.asarray(answer_ids, np.int32),
        loss_mask=np.ones(n, np.uint8), rollout_logprobs=np.zeros(n, np.float32), weight_versions=np.zeros(n, np.int64),
    )


def supervised_warmup(init_dir: pathlib.Path, out_dir: pathlib.Path, samples, steps: int, batch_size: int, lr: float,
                      seed: int, log_interval: int = 50) -> None:
    """`steps` SFT steps on `samples` (protos.sample.Sample) from `init_dir`, the result written to `out_dir` as a
    Hugging Face folder; metrics to sft_metrics.jsonl beside it (replaced: a resumed run that redoes an SFT
    cut short keeps only the whole one's)."""
    from trainer.config import TrainerConfig
    from trainer.dataset import DatasetSource
    from trainer.loop import train
    from trainer.parallel import init_distributed

    metrics_path = out_dir.parent / "sft_metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    cfg = TrainerConfig.model_validate({
        "model_path": str(init_dir),
        "algorithm": {"name": "sft"},
        "optim": {"lr": lr, "max_grad_norm": 1.0},
        "batch": {"global_batch_size": batch_size, "micro_batch_size": batch_size},
        "max_steps": steps,
        "seed": seed,
        "log_interval": log_interval,
        "checkpoint": {"export_dir": str(out_dir)},
        "metrics_path": str(metrics_path),
    })
    train(cfg, init_distributed(cfg.device, cfg.dist_timeout_s), DatasetSource(samples, seed=seed))
