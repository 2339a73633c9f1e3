"""Multi-teacher on-policy distillation (MOPD), the driver's side: each prompt's metadata names its domain and
the domain names its teacher. No call is made here (channels connect lazily); tests/test_distill_e2e.py checks
the served logprobs token by token and that the student learns."""

import dataclasses

import pytest

from deploy.experiment.tasks import arithmetic_tasks, write_jsonl
from rollout.driver.driver import Driver, DriverConfig, load_prompts


def config(tmp_path, tiny_model_dir, **teachers) -> DriverConfig:
    tasks = [dataclasses.replace(task, metadata={"domain": domain})
             for op, domain in (("+", "add"), ("-", "sub")) for task in arithmetic_tasks(digits=1, op=op)]
    tasks.append(arithmetic_tasks(digits=1)[0])  # no domain at all
    return DriverConfig.model_validate({
        "rollout": "127.0.0.1:1", "reward": "127.0.0.1:2", "buffer": "127.0.0.1:3", "tokenizer": str(tiny_model_dir),
        "prompts": str(write_jsonl(tasks, tmp_path / "prompts.jsonl")), **teachers,
    })


def test_a_prompt_without_a_teacher_is_refused_at_load(tmp_path, tiny_model_dir):
    cfg = config(tmp_path, tiny_model_dir, teachers={"add": "127.0.0.1:4"})
    with pytest.raises(ValueError, match="have no teacher") as error:
        load_prompts(cfg)
    assert "metadata domain='sub'" in str(error.value) or "domain=None" in str(error.value)
    assert len(load_prompts(cfg.model_copy(update={"teacher": "127.0.0.1:5"}))) == 201


async def test_each_prompt_gets_its_domains_teacher_else_the_default(tmp_path, tiny_model_dir):
    cfg = config(tmp_path, tiny_model_dir, teacher="127.0.0.1:5",
                 teachers={"add": "127.0.0.1:4", "sub": "127.0.0.1:6", "mul": "127.0.0.1:4"})
    prompts = {p.metadata.get("domain"): p for p in load_prompts(cfg)}
    driver = Driver(cfg)
    try:
        assert driver.teacher_for(prompts["add"]) is driver.teachers["add"]
        assert driver.teacher_for(prompts["sub"]) is driver.teachers["sub"]
        assert driver.teacher_for(prompts[None]) is driver.default_teacher
        assert driver.teachers["mul"] is driver.teachers["add"]  # one channel per address
        assert len(driver.channels) == 3 + 3
    finally:
        await driver.close()
    no_teacher = Driver(cfg.model_copy(update={"teacher": None, "teachers": {}}))
    try:
        assert no_teacher.teacher_for(prompts["add"]) is None and len(no_teacher.channels) == 3
    finally:
        await no_teacher.close()
