"""The teachers of on-policy distillation (an experiment's `teacher` / `teachers`, algorithm.name: distill): each
one more rollout service of the run, serving the teacher's folder and supervised like the others; the driver asks
it for the logprob of every token the student sampled (rollout.driver.DriverConfig `teacher`, `teachers`).

    teacher_services(config)   what each teacher serves: {driver key: `relayrl serve rollout` --set overrides}
    start_teachers(plan, ...)  each started and supervised: {driver key: address}
    driver_fields(addresses)   the driver's `teacher` (the default: DEFAULT's) and `teachers` (per domain)

The driver reaches its teachers over plain gRPC on this machine (it has no client settings for them), so a
teacher takes no TLS or tokens from services.rollout.
"""

import pathlib

DEFAULT = ""  # the key of `teacher`: it teaches the prompts whose domain `teachers` does not list


def teacher_services(config) -> dict[str, dict]:
    """The rollout --set overrides of each teacher of `config` (deploy.experiment.schema.ExperimentConfig), by the key the
    driver knows it by: DEFAULT for `teacher`, the domain for `teachers`."""
    named = {DEFAULT: config.teacher} if config.teacher is not None else {}
    named.update(config.teachers)
    return {key: {"model": teacher.path, "engine.seed": config.seed, **teacher.settings}
            for key, teacher in named.items()}


def start_teachers(plan, supervisor, launcher, logs: pathlib.Path, registry: pathlib.Path) -> dict[str, str]:
    """Start each teacher of `plan` (deploy.rl.config.Pipeline) under `supervisor`, named teacher or
    teacher-DOMAIN in the run (logs, services.json); where each listens."""
    addresses = {}
    for key, overrides in plan.teachers.items():
        label = f"teacher-{key}" if key else "teacher"
        addresses[key] = supervisor.add_service(launcher.service("rollout", overrides, logs, registry,
                                                                 label=label)).address
    return addresses


def driver_fields(addresses: dict[str, str]) -> dict:
    """The driver's teacher fields for teachers listening at `addresses` (none: no fields)."""
    fields: dict = {"teachers": {key: address for key, address in addresses.items() if key != DEFAULT}}
    if DEFAULT in addresses:
        fields["teacher"] = addresses[DEFAULT]
    return fields if addresses else {}
