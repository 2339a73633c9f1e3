"""What the trainer would refuse of an experiment file, found when the file is read (so by `relayrl run`, `relayrl doctor
EXPERIMENT.yaml` and `relayrl sweep` before any trial), not on the trainer's first batch after the services started.

The trainer's config a run writes (deploy/rl/config.py: trainer_config; deploy/runs/offline.py for DPO) is made of the
file's algorithm and training sections, the KL reference (deploy/experiment/reference.py) and services.trainer.settings
laid over them. Here the same pieces are put together, the run's addresses and paths left out, and checked as the
trainer checks them: validated as trainer.config.TrainerConfig (an unknown or bad field of services.trainer.settings; a
combination the trainer refuses at its start), the batch split over its processes and tensor-parallel groups
(trainer/learner.py, trainer/parallel/mesh.py), and reference logprobs for a KL term (trainer/learner.py: _recompute,
which raised on the first batch when there was none).
"""

from pydantic import ValidationError

from deploy.experiment.forms import OFFLINE
from deploy.experiment.reference import reference_path, uses_reference

SETTINGS = "services.trainer.settings"


def merged(base: dict, extra: dict) -> dict:
    """`base` with `extra` laid over it, section by section (nested dicts merged, anything else replaced)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def nested(overrides: dict) -> dict:
    """{'engine.dtype': 'bfloat16'} -> {'engine': {'dtype': 'bfloat16'}}, as `--set` applies them."""
    from services.config import apply_override

    out: dict = {}
    for key, value in overrides.items():
        apply_override(out, key.split("."), value)
    return out


def trainer_problems(config) -> list[str]:
    """What the trainer would refuse of the config a run of `config` (deploy.experiment.schema.ExperimentConfig) gives
    it, each problem naming the field and the fix; [] = nothing."""
    from trainer.config import TrainerConfig

    training, placement = config.training, config.services.trainer
    world = 1 if config.algorithm.name in OFFLINE else placement.world_size  # an offline run trains in one process
    settings = nested(placement.settings)
    reference = reference_path(config, "<the model RL starts from>")
    planned = {
        "model_path": "<the model RL starts from>",
        "algorithm": config.algorithm.model_dump(mode="json"),
        "batch": {"global_batch_size": training.batch_size, "mini_batches": training.mini_batches,
                  "micro_batch_size": max(1, training.batch_size // training.mini_batches // world)},
        "publish": {"receivers": ["<the rollout>"]},
        **({"moe": {"routing_replay": training.routing_replay}} if training.routing_replay != "off" else {}),
        **({"ref_model_path": reference} if reference else {}),
    }
    try:
        trainer = TrainerConfig.model_validate(merged(planned, settings))
    except ValidationError as exc:
        return [_named(err) for err in exc.errors()]
    problems = _routing_problems(config, trainer)
    tp, ep = trainer.parallel.tp, trainer.parallel.ep
    if world % tp:
        problems.append(f"{SETTINGS}.parallel.tp={tp}: does not divide the trainer's {world} processes "
                        "(services.trainer nodes x procs_per_node): give a tp that divides them")
    elif (world // tp) % ep:
        problems.append(f"{SETTINGS}.parallel.ep={ep}: does not divide the trainer's {world // tp} data-parallel "
                        "ranks (its experts are split over ranks the data-parallel groups lend): give an ep that "
                        "divides them")
    else:
        try:
            trainer.batch.check_divisible(world // tp)
        except ValueError as exc:
            problems.append(f"{SETTINGS}: {exc}: unset batch.micro_batch_size (the run sets a rank's share of a step)"
                            " or give one that divides it")
    if uses_reference(config) and trainer.ref_model_path is None:
        problems.append(f"{SETTINGS}.ref_model_path: null, but algorithm {config.algorithm.name} (kl_coef "
                        f"{config.algorithm.kl_coef:g}, kl_reward_coef {config.algorithm.kl_reward_coef:g}) needs "
                        "reference logprobs: remove it (the model RL starts from is the reference) or name one with "
                        "reference: {path: FOLDER}")
    return problems


def _routing_problems(config, trainer) -> list[str]:
    """Routing replay needs routes from the rollout: only the native engine records them."""
    engine = nested(config.services.rollout.settings).get("engine", {}).get("type", "native")
    if trainer.moe.routing_replay == "rollout" and engine != "native":
        return [(f"training.routing_replay: rollout, but the {engine} rollout engine (services.rollout.settings."
                 "engine.type) does not report the experts each token was routed to; only the native engine does: "
                 "serve the policy with it, or set routing_replay: off")]
    return []


def _named(err: dict) -> str:
    """A TrainerConfig validation error as a problem of the experiment file's field."""
    where = ".".join(str(part) for part in err["loc"])
    message = err["msg"].removeprefix("Value error, ")
    return f"{SETTINGS}{'.' + where if where else ''}: {message} (trainer.config.TrainerConfig documents each field)"
