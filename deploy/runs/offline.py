"""An offline run of an experiment file (`algorithm.name: dpo`): preference pairs from the data, trained in this
process through the training loop RL uses, with no service started.

    the data's (prompt, chosen, rejected) rows -> a group of two samples each (deploy/experiment/data.py maps them)
    -> the policy the run starts from (model, or its SFT warm-up on the chosen responses: deploy/runs/experiment_run.py)
    -> held-out figures on the eval pairs, at the start
    -> trainer.loop.train over trainer.dataset.DatasetSource: training.max_steps steps (or until time_budget_s), the
       reference = the policy it starts from (or the file's `reference`); checkpoints in RUN_DIR/checkpoints, the
       weights in checkpoint.export_dir
    -> the same held-out figures at the end, in metrics.jsonl and the summary

The held-out figures: the preference accuracy (the share of eval pairs where the policy gives the chosen response
the higher log-likelihood), and the DPO reward margin beta * ((chosen - ref chosen) - (rejected - ref rejected))
with the share of pairs where it is positive (the trainer's reward_margin and reward_accuracy, held out).
"""

import json
import pathlib
import shutil
import threading
import time

EVAL_BATCH = 64  # sequences per forward pass of the held-out figures


def preference_pair(prompt_id: str, prompt_ids: list[int], chosen_ids: list[int], rejected_ids: list[int]) -> list:
    """One DPO pair as the trainer takes it (protos.sample.Sample): a group of two samples of `prompt_id`, the chosen
    response with reward 1 and the rejected one with reward 0 (the trainer puts the higher first:
    trainer.batch.order_preference_pairs), the loss on every response token."""
    import numpy as np

    from protos.sample import Sample

    samples = []
    for name, response, reward in (("chosen", chosen_ids, 1.0), ("rejected", rejected_ids, 0.0)):
        n = len(response)
        samples.append(Sample(
            sample_id=f"dpo/{prompt_id}/{name}", prompt_id=prompt_id, group_id=f"dpo/{prompt_id}", group_size=2,
            prompt_ids=np.asarray(prompt_ids, np.int32), response_ids=np.asarray(response, np.int32),
            loss_mask=np.ones(n, np.uint8), rollout_logprobs=np.zeros(n, np.float32),
            weight_versions=np.zeros(n, np.int64), reward=reward,
        ))
    return samples


def pair_samples(rows, tokenizer, add_bos: bool) -> list:
    """The pairs of `rows` (deploy.experiment.data.PromptRow, metadata answer = chosen and rejected): each prompt
    tokenized as the driver would (deploy.experiment.data.prompt_ids), each response followed by eos."""
    from deploy.experiment.data import prompt_ids

    def response(text) -> list[int]:
        return [*tokenizer.encode(str(text), add_special_tokens=False), tokenizer.eos_token_id]

    return [sample for row in rows for sample in preference_pair(
        row.prompt_id, prompt_ids(row, tokenizer, add_bos), response(row.metadata["answer"]),
        response(row.metadata["rejected"]))]


def sequence_logprobs(model, samples, device) -> list[float]:
    """log p(response | prompt) of each sample under `model` (a causal LM on `device`), in right-padded batches."""
    import torch

    totals = []
    with torch.no_grad():
        for start in range(0, len(samples), EVAL_BATCH):
            chunk = samples[start:start + EVAL_BATCH]
            rows = [[*s.prompt_ids.tolist(), *s.response_ids.tolist()] for s in chunk]
            width = max(map(len, rows))
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            mask = torch.zeros(len(rows), width, dtype=torch.long)
            for index, row in enumerate(rows):
                ids[index, :len(row)] = torch.tensor(row)
                mask[index, :len(row)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits[:, :-1].float()
            picked = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None].to(device))[..., 0].cpu()
            for index, sample in enumerate(chunk):
                start_at = sample.prompt_ids.size - 1  # the logit at position i predicts token i + 1
                totals.append(float(picked[index, start_at:start_at + sample.response_ids.size].sum()))
    return totals


def held_out_figures(policy: list[float], reference: list[float], beta: float) -> dict:
    """The preference accuracy on the eval pairs of a policy whose logprobs of their samples ([chosen, rejected, ...])
    are `policy`, and its DPO reward margin and accuracy against the reference's logprobs of the same samples."""
    pairs = len(policy) // 2
    margins = [beta * ((policy[2 * i] - reference[2 * i]) - (policy[2 * i + 1] - reference[2 * i + 1]))
               for i in range(pairs)]
    return {"preference_accuracy": sum(policy[2 * i] > policy[2 * i + 1] for i in range(pairs)) / pairs,
            "reward_margin": sum(margins) / pairs, "reward_accuracy": sum(m > 0 for m in margins) / pairs}


def folder_logprobs(folder: pathlib.Path, samples, device) -> list[float]:
    """sequence_logprobs of `samples` under the model saved in `folder`."""
    from transformers import AutoModelForCausalLM

    return sequence_logprobs(AutoModelForCausalLM.from_pretrained(folder).to(device).eval(), samples, device)


def trainer_config(config, run_dir: pathlib.Path, policy_dir: pathlib.Path, export_dir: pathlib.Path):
    """trainer.config.TrainerConfig of the offline run of `config` (deploy.experiment.schema.ExperimentConfig): the policy
    `policy_dir`, its reference the same unless the file names one (`reference`), a batch of training.groups_per_batch pairs, services.trainer.settings laid
    over it."""
    from deploy.experiment.reference import reference_path
    from deploy.rl.config import merged, nested
    from trainer.config import TrainerConfig

    training, checkpoint = config.training, config.checkpoint
    return TrainerConfig.model_validate(merged({
        "model_path": str(policy_dir), "ref_model_path": reference_path(config, policy_dir),
        "algorithm": config.algorithm.model_dump(mode="json"),
        "optim": {"lr": training.lr, "warmup_steps": training.warmup_steps, "max_grad_norm": 1.0},
        "batch": {"global_batch_size": training.batch_size, "mini_batches": training.mini_batches,
                  "micro_batch_size": training.batch_size // training.mini_batches,
                  **({"max_tokens_per_micro_batch": training.max_tokens_per_micro_batch}
                     if training.max_tokens_per_micro_batch else {})},
        "max_steps": training.max_steps, "seed": config.seed, "deterministic": config.deterministic,
        "log_interval": 10, "metrics_path": str(run_dir / "trainer_metrics.jsonl"),
        "metrics_sample_ids": training.metrics_sample_ids,
        "checkpoint": {"dir": str(run_dir / "checkpoints"), "interval": checkpoint.interval,
                       "keep_last": checkpoint.keep_last, "export_dir": str(export_dir)},
    }, nested(config.services.trainer.settings)))


def train_offline(config, run_dir: pathlib.Path, policy_dir: pathlib.Path, tokenizer, train_rows, eval_rows,
                  progress):
    """The offline run of `config` from `policy_dir` (the start, also the reference) on the pairs of `train_rows`,
    measured on those of `eval_rows`; returns deploy.record.run_state.Summary (its accuracy fields hold the held-out
    preference accuracy). The trainer resumes from RUN_DIR/checkpoints when a resumed run left one."""
    from deploy.record.run_state import Summary
    from deploy.rl.plan import add_bos
    from services.device import resolve_device
    from trainer.dataset import DatasetSource
    from trainer.loop import train
    from trainer.parallel import init_distributed

    samples, held_out = (pair_samples(rows, tokenizer, add_bos(config)) for rows in (train_rows, eval_rows))
    export_dir = pathlib.Path(config.checkpoint.export_dir or run_dir / ".model-final")  # measured, then removed
    trainer = trainer_config(config, run_dir, policy_dir, export_dir)
    device = resolve_device(trainer.device)
    beta = config.algorithm.dpo_beta
    reference = folder_logprobs(pathlib.Path(trainer.ref_model_path), held_out, device)
    start_logprobs = reference if trainer.ref_model_path == str(policy_dir) else folder_logprobs(policy_dir, held_out,
                                                                                                 device)
    start = held_out_figures(start_logprobs, reference, beta)  # the policy starts as its reference unless one is named
    curve = [_point(progress, 0.0, 0, start)]
    stop = threading.Event()
    timer = threading.Timer(config.training.time_budget_s, stop.set)
    timer.daemon = True
    began = time.monotonic()
    with progress.phase(f"DPO: {trainer.max_steps} steps of {config.training.groups_per_batch} pairs "
                        f"({len(samples) // 2} train pairs)"):
        timer.start()
        try:
            state = train(trainer, init_distributed(trainer.device, trainer.dist_timeout_s),
                          DatasetSource(samples, seed=config.seed), stop=stop)
        finally:
            timer.cancel()
    seconds = time.monotonic() - began
    end = held_out_figures(folder_logprobs(export_dir, held_out, device), reference, beta)
    curve.append(_point(progress, seconds, state.step, end))
    if config.checkpoint.export_dir:
        progress.note(f"exported the weights of step {state.step} to {export_dir}")
    else:
        shutil.rmtree(export_dir)
    stopped = " (stopped by training.time_budget_s)" if stop.is_set() else ""
    progress.note(f"held-out pairs ({len(held_out) // 2}): preference accuracy {start['preference_accuracy']:.3f} -> "
                  f"{end['preference_accuracy']:.3f}, mean DPO margin {start['reward_margin']:.3f} -> "
                  f"{end['reward_margin']:.3f} (positive in {end['reward_accuracy']:.3f} of them) after {state.step} "
                  f"steps{stopped}")
    summary = Summary(seed=config.seed, sft_accuracy=start["preference_accuracy"],
                      final_accuracy=end["preference_accuracy"],
                      best_accuracy=max(start["preference_accuracy"], end["preference_accuracy"]), steps=state.step,
                      completions=0, rl_seconds=seconds, curve=curve, run_dir=str(run_dir))
    progress.finish(summary)
    return summary


def _point(progress, elapsed: float, step: int, figures: dict) -> dict:
    """One held-out measurement, appended to RUN_DIR/metrics.jsonl (`accuracy` = the preference accuracy)."""
    point = {"elapsed_s": round(elapsed, 2), "step": step, "accuracy": figures["preference_accuracy"], **figures}
    with open(progress.metrics_path, "a") as out:
        out.write(json.dumps(point) + "\n")
    return point
