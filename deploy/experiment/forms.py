"""The forms of run one experiment file can ask for, and what each needs of the file's other sections.

    online RL (grpo, ppo, ...)  prompts from `data` or `env`, completions scored by the reward (deploy/rl/pipeline.py)
    offline DPO (algorithm.name: dpo)  the data's (prompt, chosen, rejected) rows, trained in one process
                                       (deploy/runs/offline.py); no services, no reward
    distillation (algorithm.name: distill)  the student's own completions, each token scored by a served
                                            teacher (`teacher` / `teachers`, deploy/experiment/teachers.py)

deploy/experiment/schema.py calls form_problems when a file is loaded, so a run of the wrong shape is refused before it
starts, with the fix.
"""

from pydantic import Field

from services.config import Strict

OFFLINE = ("dpo",)  # algorithms trained on the data's fixed samples, not on the rollout


def form_problems(config) -> list[str]:
    """What is wrong with `config` (deploy.experiment.schema.ExperimentConfig) for the form of run its algorithm asks for."""
    name = config.algorithm.name
    data = config.data
    if problems := _teacher_problems(config):
        return problems
    pairs = data is not None and (data.chosen_field is not None or data.rejected_field is not None)
    if name not in OFFLINE:
        if pairs:
            return [("data.chosen_field / rejected_field: preference pairs are trained by DPO (algorithm.name: "
                     f"dpo); a {name} run trains on its own completions: remove them, or set algorithm.name: dpo")]
        return _buffer_problems(config)
    return _offline_problems(config)


def _buffer_problems(config) -> list[str]:
    """An online run's batches pass through the buffer, which holds each one trained (leased) until the trainer's
    next checkpoint: more steps between checkpoints than batches it holds fills it, and a run longer than that
    stalls."""
    interval, capacity = config.checkpoint.interval, config.training.buffer_capacity_batches
    max_steps = config.training.max_steps
    if interval > capacity and (max_steps is None or max_steps > capacity):
        return [(f"checkpoint.interval ({interval}) > training.buffer_capacity_batches ({capacity}): the buffer "
                 "holds every batch trained until the next checkpoint, so it fills before one is saved and the run "
                 f"stalls at step {capacity}: checkpoint every {capacity} steps or fewer, or raise "
                 "buffer_capacity_batches")]
    return []


def _offline_problems(config) -> list[str]:
    data, training = config.data, config.training
    if data is None:
        return [("dpo: trains on preference pairs in the data: give data (with chosen_field and rejected_field), "
                 "not env")]
    problems = []
    missing = [name for name in ("chosen_field", "rejected_field") if getattr(data, name) is None]
    if missing:
        problems.append(f"data.{' and data.'.join(missing)}: dpo trains on (prompt, chosen, rejected) rows: name the "
                        "field holding the preferred response (chosen_field) and the dispreferred one (rejected_field)")
    if data.answer_field is not None:
        problems.append(f"data.answer_field ({data.answer_field!r}): with preference pairs the chosen response is the "
                        "answer (an SFT warm-up learns it): set answer_field: null")
    if training.group_size != 2:
        problems.append(f"training.group_size ({training.group_size}): a DPO pair is a group of 2 (chosen, "
                        "rejected): set group_size: 2 (groups_per_batch = pairs per batch)")
    if training.groups_per_batch % training.mini_batches:
        problems.append(f"training.mini_batches ({training.mini_batches}) must divide groups_per_batch "
                        f"({training.groups_per_batch}): each optimizer step trains whole pairs")
    if training.max_steps is None:
        problems.append("training.max_steps: required for an offline run (dpo): the optimizer steps over the pairs "
                        "(time_budget_s still stops it sooner)")
    if config.reward.custom:
        problems.append("reward: dpo learns from the pairs, no reward scores anything: remove the reward section")
    if config.services.trainer.world_size > 1:
        problems.append("services.trainer: an offline run (dpo) trains in the run's own process, one of it: "
                        "nodes and procs_per_node must be 1")
    return problems


class TeacherSection(Strict):
    """A teacher of on-policy distillation: a model folder served as an extra rollout service, whose logprob of
    every token the student samples becomes the samples' ref_logprobs (rollout/driver: `teacher`, `teachers`)."""

    path: str = Field(description="Hugging Face folder of the teacher; it must hold the same tokenizer and vocabulary "
                      "as the student (relayrl doctor checks).")
    made_by: str | None = Field(None, description="The command that makes `path` (e.g. `relayrl run "
                                "examples/algorithms/grpo.yaml`), named by relayrl doctor when the folder is missing.")
    settings: dict = Field(default_factory=dict, description="Extra --set overrides of the teacher's rollout service "
                           "(e.g. engine.dtype).")


def teacher_folders(config) -> list[tuple[str, TeacherSection]]:
    """(The field naming it, the teacher) for each teacher of `config`: `teacher`, then `teachers.KEY`."""
    named = [("teacher", config.teacher)] if config.teacher is not None else []
    return named + [(f"teachers.{key}", teacher) for key, teacher in config.teachers.items()]


def _teacher_problems(config) -> list[str]:
    taught = bool(config.teacher is not None or config.teachers)
    if config.algorithm.name != "distill":
        return [(f"teacher / teachers: only on-policy distillation (algorithm.name: distill) asks a teacher; a "
                 f"{config.algorithm.name} run does not: remove them, or set algorithm.name: distill")] if taught else []
    if not taught:
        return [("algorithm distill: needs a teacher: teacher: {path: FOLDER}, or a teacher per domain "
                 "(teachers: {KEY: {path: FOLDER}} chosen by each prompt's metadata[teacher_key])")]
    if config.env is not None:
        return ["algorithm distill: not with env (the episode runner asks no teacher): give data"]
    if config.teachers and config.data is not None and config.teacher_key not in config.data.metadata_fields:
        return [(f"teachers: each prompt's teacher is named by its metadata field {config.teacher_key!r} "
                 "(teacher_key): list it in data.metadata_fields")]
    return []
