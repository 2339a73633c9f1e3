"""The KL reference: the frozen model a KL term measures the policy against (algorithm.kl_coef, verl's use_kl_loss and
TRL's beta; algorithm.kl_reward_coef, verl's use_kl_in_reward).

By default it is the model RL starts from (the SFT warm-up's output when there is one: RUN_DIR/model-sft, or a
sweep's shared SFT), frozen, as verl, TRL and slime take it; `reference: {path: FOLDER}` names another, which must hold
the policy's tokenizer and vocabulary (`relayrl doctor EXPERIMENT.yaml` checks it as it checks a teacher). The trainer
computes the reference logprobs itself, in a forward-only pass of the frozen model over each batch before the update
(trainer/learner.py: Learner._recompute): the batch is already on its device in its micro-batches, so this costs one
forward, not a service of its own nor a second engine in the rollout. Distillation's reference logprobs are its
teacher's (deploy/experiment/teachers.py); DPO's reference is the policy it starts from unless one is named.
"""

import pathlib

from pydantic import Field

from services.config import Strict


class ReferenceSection(Strict):
    """The KL reference, when it is not the model RL starts from."""

    path: str = Field(description="Hugging Face folder of the reference; it must hold the policy's tokenizer and "
                      "vocabulary (relayrl doctor checks). Relative: to the experiment file.")
    made_by: str | None = Field(None, description="The command that makes `path`, named by relayrl doctor when the "
                                "folder is missing.")


def uses_reference(config) -> bool:
    """Whether the trainer of `config` (deploy.experiment.schema.ExperimentConfig) needs reference logprobs it computes
    itself: a KL term or penalty of an RL run, or DPO (distillation's come with the samples, from its teacher)."""
    return config.algorithm.needs_reference and config.algorithm.name != "distill"


def reference_path(config, start: pathlib.Path) -> str | None:
    """The reference folder the trainer loads (its ref_model_path): `reference.path`, else `start`, the model RL (or DPO)
    starts from; None when nothing uses one."""
    if not uses_reference(config):
        return None
    return config.reference.path if config.reference is not None else str(start)


def reference_problems(config) -> list[str]:
    """What is wrong with the file's `reference` (none given is never wrong: the start is the reference)."""
    if config.reference is None:
        return []
    if config.algorithm.name == "distill":
        return [("reference: distillation measures the student against its teacher (teacher / teachers), whose "
                 "logprobs come with every sample: remove reference")]
    if "ref_model_path" in config.services.trainer.settings:
        return [("reference and services.trainer.settings.ref_model_path both name the reference: give reference.path "
                 "alone")]
    return []
