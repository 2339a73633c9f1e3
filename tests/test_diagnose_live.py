"""`relayrl doctor RUN_DIR` on runs broken on purpose, made here for real (tests/broken_runs.py): a trainer killed
until its restarts run out, a reward registered by path that always returns 0, a publish to a receiver that refuses
connections. The doctor names each seeded fault, and only that one among its errors."""

import pytest
from broken_runs import FAULTS, broken_run

from deploy.inspect.diagnose import diagnose_run

NAMED = {  # the fault -> (the checks that must report an error, words of the finding)
    "killed_trainer": ({"outcome", "restart loop"}, "trainer went down 3 times (exited with code -9 x3)"),
    "zero_reward": ({"rewards"}, "trained batches scored 0: GRPO's advantages are all zero"),
    "publish_refused": ({"weight versions"}, "no weight version reached the rollout"),
}


@pytest.mark.extended
@pytest.mark.timeout(400)
@pytest.mark.parametrize("fault", FAULTS)
def test_the_doctor_names_the_fault_seeded_in_a_real_run(fault, tmp_path):
    run_dir = broken_run(fault, tmp_path)
    findings = diagnose_run(run_dir)
    errors = {f.check: f for f in findings if f.level == "error"}
    checks, words = NAMED[fault]
    report = "\n".join(f.render() for f in findings)
    assert set(errors) == checks, report
    assert any(words in f.message for f in errors.values()), report
    assert all(f.evidence and f.fix for f in errors.values()), report
