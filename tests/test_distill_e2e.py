"""On-policy distillation end to end: the teacher is a second rollout service; the driver asks it for
the logprobs of every token the student sampled, and the trainer's reverse KL to it falls."""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from deploy.tasks import arithmetic_tasks, write_jsonl
from rollout.tiny import write_tiny_model

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20


def sharp_teacher(path: Path) -> Path:
    """A tiny model with a peaked next-token distribution, far from a fresh student's near-uniform one."""
    folder = write_tiny_model(path, seed=1)
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


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_distillation_from_a_served_teacher_lowers_reverse_kl(tmp_path, service_factory):
    student_dir = write_tiny_model(tmp_path / "student", seed=0)
    teacher_dir = sharp_teacher(tmp_path / "teacher")
    engine = {"engine.torch_threads": 1, "engine.max_model_len": 64}
    student = service_factory("rollout", {"model": str(student_dir), **engine})
    teacher = service_factory("rollout", {"model": str(teacher_dir), **engine})
    reward = service_factory("reward", {})
    buffer = service_factory("buffer", {"data_dir": str(tmp_path / "buffer"), "max_staleness": 1})
    prompts = write_jsonl(arithmetic_tasks(digits=1), tmp_path / "prompts.jsonl")
    driver_cfg = write_yaml(tmp_path / "driver.yaml", {
        "rollout": student.address, "teacher": teacher.address, "reward": reward.address,
        "buffer": buffer.address, "prompts": str(prompts), "tokenizer": str(student_dir), "group_size": 4,
        "groups_per_batch": 4, "max_staleness": 1, "max_tokens": 6, "concurrency": 4,
    })
    metrics = tmp_path / "metrics.jsonl"
    trainer_cfg = write_yaml(tmp_path / "trainer.yaml", {
        "model_path": str(student_dir),
        "algorithm": {"name": "distill"},
        "optim": {"lr": 3e-3, "max_grad_norm": 1.0},
        "batch": {"global_batch_size": 16, "micro_batch_size": 16},
        "buffer": {"address": buffer.address, "max_wait_s": 120},
        "max_steps": STEPS,
        "max_staleness": 1,
        "publish": {"receivers": [student.address]},
        "metrics_path": str(metrics),
    })
    trainer = start(["-m", "trainer", "--config", str(trainer_cfg)], tmp_path / "trainer.log")
    driver = start(["-m", "rollout.driver", "--config", str(driver_cfg)], tmp_path / "driver.log")
    try:
        assert trainer.wait(timeout=400) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for proc in (driver, trainer):
            proc.terminate()
            proc.wait(timeout=30)

    steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(steps) == STEPS
    first = statistics.mean(s["reverse_kl"] for s in steps[:4])
    last = statistics.mean(s["reverse_kl"] for s in steps[-4:])
    assert first > 0.5, f"the teacher should start far from the student (reverse KL {first:.3f})"
    assert last < 0.6 * first, f"reverse KL to the served teacher did not fall: {first:.3f} -> {last:.3f}"
