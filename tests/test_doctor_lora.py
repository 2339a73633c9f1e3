"""`relayrl doctor` on a LoRA experiment: the native engine serving adapters unmerged keeps enough versions resident
(engine.lora.versions_resident >= training.max_staleness + 1) for every rollout to finish on its own policy."""

import pathlib

import pytest

from deploy.experiment.schema import load_experiment
from deploy.inspect.doctor import check_lora

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "lora" / "quickstart_lora.yaml"


def lora_findings(*overrides: str):
    findings = []
    check_lora(load_experiment(EXAMPLE, list(overrides)), findings)
    return findings


@pytest.mark.parametrize(("overrides", "level", "says"), [
    ((), "ok", "2 versions resident (>= training.max_staleness + 1 = 2)"),  # the defaults: max_staleness 1, 2 versions
    (("training.max_staleness=3",), "warn", "versions_resident = 2 < training.max_staleness + 1 = 4"),
    (("training.max_staleness=3", "services.rollout.settings={\"engine.lora.versions_resident\": 4}"), "ok", "4 versions"),
    (("training.max_staleness=3", "services.rollout.settings={\"engine.lora.mode\": \"merged\"}"), "ok", "merges"),
])
def test_versions_resident_is_checked_against_max_staleness(overrides, level, says):
    [finding] = lora_findings(*overrides)
    assert finding.level == level and says in finding.message, finding
    if level == "warn":
        assert "engine.lora.versions_resident: 4" in finding.fix


def test_no_lora_no_finding():
    assert lora_findings("model.lora=null") == []
