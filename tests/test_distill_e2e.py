"""On-policy distillation end to end: the teacher is a second rollout service; the driver asks it for
the logprobs of every token the student sampled, and the trainer's reverse KL to it falls.

The distillation family's examples run here: examples/algorithms/distill.yaml (one teacher) and mopd.yaml (a
teacher per domain: the driver's `teachers`, chosen by each prompt's metadata `domain`).
"""

import asyncio
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from deploy.tasks import arithmetic_tasks, write_jsonl
from rollout.model.tiny import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "algorithms"
ENGINE = {"engine.torch_threads": 1, "engine.max_model_len": 64}

pytestmark = [pytest.mark.slow, pytest.mark.families]


def sharp_teacher(path: Path, seed: int = 1) -> Path:
    """A tiny model with a peaked next-token distribution, far from a fresh student's near-uniform one."""
    folder = write_tiny_model(path, seed=seed)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"] * 12.0
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def start(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def write_yaml(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def example(name: str) -> dict:
    return yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())


def distill(tmp_path: Path, student_dir: Path, trainer_yaml: dict, driver_cfg: dict) -> list[dict]:
    """The example's trainer against a driver configured with its services; each step's metrics."""
    metrics = tmp_path / "metrics.jsonl"
    trainer_cfg = write_yaml(tmp_path / "trainer.yaml", {
        **trainer_yaml, "model_path": str(student_dir), "metrics_path": str(metrics),
        "buffer": {"address": driver_cfg["buffer"], "max_wait_s": 120},
        "publish": {"receivers": [driver_cfg["rollout"]]},
    })
    driver_path = write_yaml(tmp_path / "driver.yaml", driver_cfg)
    trainer = start(["-m", "trainer", "--config", str(trainer_cfg)], tmp_path / "trainer.log")
    driver = start(["-m", "rollout.driver", "--config", str(driver_path)], tmp_path / "driver.log")
    try:
        assert trainer.wait(timeout=400) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for proc in (driver, trainer):
            proc.terminate()
            proc.wait(timeout=30)
    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(steps) == trainer_yaml["max_steps"]
    return steps


def assert_reverse_kl_falls(steps: list[dict]) -> None:
    # The start against the last tenth of the run: one step's reverse KL is a 16-sample estimate and swings.
    first = statistics.mean(s["reverse_kl"] for s in steps[:4])
    last = statistics.mean(s["reverse_kl"] for s in steps[-max(len(steps) // 10, 4):])
    print(f"reverse KL to the teacher {first:.3f} -> {last:.3f} over {len(steps)} steps")
    assert first > 0.5, f"the teacher should start far from the student (reverse KL {first:.3f})"
    assert last < 0.6 * first, f"reverse KL to the served teacher did not fall: {first:.3f} -> {last:.3f}"


@pytest.mark.timeout(600)
def test_distillation_from_a_served_teacher_lowers_reverse_kl(tmp_path, service_factory):
    student_dir = write_tiny_model(tmp_path / "student", seed=0)
    teacher_dir = sharp_teacher(tmp_path / "teacher")
    student = service_factory("rollout", {"model": str(student_dir), **ENGINE})
    teacher = service_factory("rollout", {"model": str(teacher_dir), **ENGINE})
    reward = service_factory("reward", {})
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "max_staleness": 1})
    prompts = write_jsonl(arithmetic_tasks(digits=1), tmp_path / "prompts.jsonl")
    config = example("distill")
    steps = distill(tmp_path, student_dir, config["trainer"], {
        **config["driver"], "rollout": student.address, "teacher": teacher.address, "reward": reward.address,
        "buffer": buffer.address, "prompts": str(prompts), "tokenizer": str(student_dir),
    })
    assert_reverse_kl_falls(steps)


@torch.no_grad()
def teacher_logprobs(model, sample) -> torch.Tensor:
    """log p_teacher of each response token of `sample` at temperature 1 (the driver's)."""
    ids = torch.tensor([[*sample.prompt_ids.tolist(), *sample.response_ids.tolist()]])
    logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
    picked = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
    return picked[sample.prompt_ids.size - 1:]


@pytest.mark.timeout(600)
def test_distillation_from_a_teacher_per_domain(tmp_path, service_factory):
    """MOPD: addition prompts take their ref_logprobs from one teacher, subtraction from another (checked token
    by token against each teacher's own forward pass), and the student's reverse KL to them falls."""
    from transformers import AutoModelForCausalLM

    from rollout.driver.driver import DriverConfig, drive
    from trainer.buffer_client import BufferClient
    from trainer.config.buffer import BufferClientConfig

    student_dir = write_tiny_model(tmp_path / "student", seed=0)
    teacher_dirs = {"add": sharp_teacher(tmp_path / "teacher-add", seed=1),
                    "sub": sharp_teacher(tmp_path / "teacher-sub", seed=2)}
    student = service_factory("rollout", {"model": str(student_dir), **ENGINE})
    teachers = {domain: service_factory("rollout", {"model": str(folder), **ENGINE})
                for domain, folder in teacher_dirs.items()}
    reward = service_factory("reward", {})
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "max_staleness": 1})
    tasks = [dataclasses.replace(task, metadata={"domain": domain})
             for op, domain in (("+", "add"), ("-", "sub")) for task in arithmetic_tasks(digits=1, op=op)]
    config = example("mopd")
    driver_cfg = {
        **config["driver"], "rollout": student.address, "reward": reward.address, "buffer": buffer.address,
        "teachers": {domain: service.address for domain, service in teachers.items()},
        "prompts": str(write_jsonl(tasks, tmp_path / "prompts.jsonl")), "tokenizer": str(student_dir),
    }

    # One batch from the driver alone: every sample's ref_logprobs are its own domain's teacher's.
    groups = driver_cfg["groups_per_batch"]
    asyncio.run(drive(DriverConfig.model_validate({**driver_cfg, "max_groups": groups, "producer_id": "check"})))
    client = BufferClient(BufferClientConfig(address=buffer.address))
    batch = client.pull(groups * driver_cfg["group_size"])
    models = {domain: AutoModelForCausalLM.from_pretrained(folder) for domain, folder in teacher_dirs.items()}
    seen = set()
    for sample in batch.samples:
        domain = sample.metadata["domain"]
        other = "sub" if domain == "add" else "add"
        served = torch.tensor(sample.ref_logprobs)
        assert torch.allclose(served, teacher_logprobs(models[domain], sample), atol=1e-3), sample.sample_id
        assert (served - teacher_logprobs(models[other], sample)).abs().max() > 0.1, sample.sample_id
        seen.add(domain)
    client.ack(batch.lease_id)
    client.close()
    print(f"MOPD: {len(batch.samples)} samples of domains {sorted(seen)} carry their own teacher's logprobs")

    assert_reverse_kl_falls(distill(tmp_path, student_dir, config["trainer"], driver_cfg))
