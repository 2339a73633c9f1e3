"""On-policy distillation end to end, as `relayrl run` runs it: the experiment files examples/algorithms/distill.yaml
(one teacher) and mopd.yaml (a teacher per domain, chosen by each prompt's metadata `domain`) through
deploy.runs.experiment_run.run_experiment. Each teacher is one more rollout service of the run (deploy/experiment/teachers.py); the
driver asks it for the logprobs of every token the student sampled, and the trainer's reverse KL to it falls.

The shipped teachers are trained exports (runs/grpo/export, ...); here each is a tiny model built in code with a
sharpened lm_head (far from the fresh student), and the data are 1-digit additions (and subtractions), written to
JSONL. The overrides are what a user would pass to `relayrl run FILE --set ...`.
"""

import json
import statistics
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deploy.experiment.schema import load_experiment
from deploy.experiment.tasks import Task, arithmetic_tasks
from deploy.runs.experiment_run import run_experiment
from rollout.model.tiny import write_tiny_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "algorithms"
ENGINE = "{engine.torch_threads: 1, engine.max_model_len: 64}"  # each rollout service's, the teachers' too
HELD_OUT = 10  # prompts of each domain held out (data.eval)

pytestmark = [pytest.mark.slow, pytest.mark.families]


def sharp_teacher(path: Path, seed: int = 1) -> Path:
    """A tiny model with a peaked next-token distribution, far from a fresh student's near-uniform one."""
    folder = write_tiny_model(path, seed=seed)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 12.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def write_data(folder: Path, domains: dict[str, list[Task]]) -> list[str]:
    """train.jsonl and eval.jsonl in `folder` ({prompt_id, prompt, answer, domain}, the last HELD_OUT of each domain
    held out); the overrides pointing the experiment's data at them."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", slice(None, -HELD_OUT)), ("eval", slice(-HELD_OUT, None))):
        rows = [{"prompt_id": t.prompt_id, "prompt": t.prompt, "answer": t.answer, "domain": domain}
                for domain, tasks in domains.items() for t in tasks[part]]
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [f"data.train.path={folder / 'train.jsonl'}", f"data.eval.path={folder / 'eval.jsonl'}"]


def distill(name: str, tmp_path: Path, overrides: list[str]) -> list[dict]:
    """The example experiment file `name` run with `overrides` in tmp_path/run; each trainer step's metrics."""
    config = load_experiment(EXAMPLES / f"{name}.yaml", [
        f"run_dir={tmp_path / 'run'}", f"services.rollout.settings={ENGINE}", "logging.tensorboard=false",
        *overrides])
    summary = run_experiment(config)
    steps = [json.loads(line) for line in (tmp_path / "run" / "trainer_metrics.jsonl").read_text().splitlines()]
    assert len(steps) == config.training.max_steps == summary.steps
    return steps


def assert_falls(first: float, last: float, what: str, bar: float = 0.6) -> None:
    print(f"{what}: {first:.3f} -> {last:.3f}")
    assert first > 0.5, f"{what}: the teacher should start far from the student ({first:.3f})"
    assert last < bar * first, f"{what} did not fall below {bar} of its start: {first:.3f} -> {last:.3f}"


def assert_reverse_kl_falls(steps: list[dict]) -> None:
    # The start against the last tenth of the run: one step's reverse KL is a 16-sample estimate and swings.
    first = statistics.mean(s["reverse_kl"] for s in steps[:4])
    last = statistics.mean(s["reverse_kl"] for s in steps[-max(len(steps) // 10, 4):])
    assert_falls(first, last, f"reverse KL to the teacher over {len(steps)} steps")


@pytest.mark.timeout(600)
def test_distillation_from_a_served_teacher_lowers_reverse_kl(tmp_path):
    teacher = sharp_teacher(tmp_path / "teacher")
    data = write_data(tmp_path / "data", {"add": arithmetic_tasks(digits=1)})
    steps = distill("distill", tmp_path, [f"teacher.path={teacher}", f"teacher.settings={ENGINE}", *data])
    assert_reverse_kl_falls(steps)


@torch.no_grad()
def teacher_logprobs(model, prompt_ids: list[int], response_ids: list[int]) -> torch.Tensor:
    """log p_teacher of each response token at temperature 1 (the driver's)."""
    ids = torch.tensor([[*prompt_ids, *response_ids]])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    picked = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
    return picked[len(prompt_ids) - 1:]


def domain_reverse_kl(groups: list[dict]) -> float:
    """The mean per-token reverse KL estimate (log p_student - log p_teacher of each sampled token) of `groups`."""
    gaps = [student - teacher for group in groups for sample in group["samples"]
            for student, teacher, trained in zip(sample["logprobs"], sample["ref_logprobs"], sample["loss_mask"],
                                                 strict=True) if trained]
    return statistics.mean(gaps)


@pytest.mark.timeout(900)
def test_distillation_from_a_teacher_per_domain(tmp_path):
    """MOPD: addition prompts take their ref_logprobs from one teacher, subtraction from another (checked token by
    token against each teacher's own forward pass, on the groups the run logged), and the student's reverse KL to
    each domain's teacher falls."""
    from transformers import AutoModelForCausalLM

    teacher_dirs = {"add": sharp_teacher(tmp_path / "teacher-add", seed=1),
                    "sub": sharp_teacher(tmp_path / "teacher-sub", seed=2)}
    data = write_data(tmp_path / "data", {"add": arithmetic_tasks(digits=1, op="+"),
                                          "sub": arithmetic_tasks(digits=1, op="-")})
    teachers = [f"teachers.{domain}={{path: {folder}, settings: {ENGINE}}}" for domain, folder in teacher_dirs.items()]
    steps = distill("mopd", tmp_path, [*teachers, *data])
    assert_reverse_kl_falls(steps)

    # Every group the driver made (trajectory_log.every_n_groups: 1), with its domain and its teacher's logprobs.
    groups = [json.loads(line) for line in (tmp_path / "run" / "trajectories.jsonl").read_text().splitlines()]
    by_domain = {domain: [g for g in groups if g["prompt"]["metadata"]["domain"] == domain] for domain in teacher_dirs}
    models = {domain: AutoModelForCausalLM.from_pretrained(folder) for domain, folder in teacher_dirs.items()}
    for domain, logged in by_domain.items():
        other = "sub" if domain == "add" else "add"
        for group in logged[:4]:
            for sample in group["samples"]:
                served, ids = torch.tensor(sample["ref_logprobs"]), (group["prompt"]["ids"], sample["ids"])
                assert torch.allclose(served, teacher_logprobs(models[domain], *ids), atol=1e-3), sample["sample_id"]
                assert (served - teacher_logprobs(models[other], *ids)).abs().max() > 0.1, sample["sample_id"]
    print(f"MOPD: {len(groups)} groups logged ({', '.join(f'{d} {len(g)}' for d, g in by_domain.items())}); the "
          "first 4 of each domain carry their own teacher's logprobs")
    # The first groups (about the trainer's first 4 steps) vs the last tenth. Subtraction is learned more slowly
    # than addition (three runs: add fell to 0.26, 0.26 and 0.31 of its start, sub to 0.56, 0.60 and 0.64), so each
    # domain's bar is a fall by a fifth; a student that does not learn a domain stays at its start (~3.0 here).
    for domain, logged in by_domain.items():
        tenth = max(len(logged) // 10, 8)
        assert_falls(domain_reverse_kl(logged[:8]), domain_reverse_kl(logged[-tenth:]),
                     f"per-token reverse KL to the {domain} teacher, first 8 vs last {tenth} of {len(logged)} groups",
                     bar=0.8)
