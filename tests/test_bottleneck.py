"""`relayrl doctor RUN_DIR` names the stage a run is bound by, from the trainer's per-stage step reports
(trainer/stages.py) and the run's spans: run folders written here as a slow reward, a slow trainer, a slow rank and a
healthy run would leave them."""

import json
import pathlib

from deploy.cli import main as relayrl
from deploy.inspect.diagnose import diagnose_run
from trainer.stages import STAGES

STEPS = 12


def write_steps(run_dir: pathlib.Path, **stage_seconds: float) -> None:
    """trainer_metrics.jsonl with STEPS steps whose stages take `stage_seconds` each (the rest 0)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "trainer_metrics.jsonl", "w") as out:
        for step in range(1, STEPS + 1):
            stages = {f"stage/{name}_s": stage_seconds.get(name, 0.0) for name in STAGES}
            stages.update({key: value for key, value in stage_seconds.items() if key.startswith("stage/")})
            record = {"step": step, "reward_mean": 0.5 + 0.01 * (step % 3), "perf/mfu": 0.21,
                      "stage/step_s": sum(stage_seconds.get(name, 0.0) for name in STAGES), **stages}
            out.write(json.dumps(record) + "\n")


def write_spans(run_dir: pathlib.Path, generate_s: float, score_s: float, groups: int = 5) -> None:
    """The traced groups' rollout and reward server spans, as services/tracing.py writes them."""
    (run_dir / "traces").mkdir(parents=True, exist_ok=True)
    spans = []
    for group in range(groups):
        start = 10**18 + group * 10**10
        for service, name, seconds in (("rollout", "relayrl.rollout.v1.Rollout/GenerateMany", generate_s),
                                       ("reward", "relayrl.reward.v1.Reward/Score", score_s)):
            spans.append({"name": name, "service": service, "pid": 7, "trace_id": f"{group:032x}",
                          "span_id": f"{len(spans) + 1:016x}", "parent_span_id": None, "kind": "SERVER",
                          "start_ns": start, "end_ns": start + int(seconds * 1e9), "attributes": {}, "links": []})
            start += int(seconds * 1e9)
    (run_dir / "traces" / "spans-rollout-7.jsonl").write_text("".join(json.dumps(span) + "\n" for span in spans))


def write_driver(run_dir: pathlib.Path, held_share: float) -> None:
    """driver_stats.jsonl, a line every 2 s, generation idle (waiting on the trainer) `held_share` of the time."""
    lines = [{"elapsed_s": 2.0 * i, "idle_s": 2.0 * i * held_share, "samples": 64 * i} for i in range(1, 20)]
    (run_dir / "driver_stats.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def verdict(run_dir: pathlib.Path):
    (finding,) = [f for f in diagnose_run(run_dir) if f.check == "bottleneck"]
    return finding


def test_a_slow_reward_is_generation_bound_on_scoring(tmp_path, capsys):
    write_steps(tmp_path, data_wait=3.1, forward=0.6, backward=1.0, optimizer=0.2, publish=0.1)
    write_spans(tmp_path, generate_s=0.4, score_s=2.5)
    finding = verdict(tmp_path)
    assert finding.level == "warn" and "generation-bound" in finding.message
    assert "waited on the buffer for 62% of its time (12 of 11" not in finding.message  # the first step is left out
    assert "waited on the buffer for 62% of its time (11 of 11 steps" in finding.message, finding.message
    assert "scoring is the slow part" in finding.message and "reward replicas" in finding.fix
    assert any("Score 12.5s" in line for line in finding.evidence), finding.evidence
    assert relayrl(["doctor", str(tmp_path)]) == 0  # a warning, not a fault
    assert "WARN  bottleneck: the trainer waited on the buffer" in capsys.readouterr().out


def test_slow_generation_names_the_rollout_lever(tmp_path):
    write_steps(tmp_path, data_wait=4.0, forward=0.5, backward=0.5)
    write_spans(tmp_path, generate_s=3.0, score_s=0.1)
    finding = verdict(tmp_path)
    assert "generation-bound" in finding.message and "generating is the slow part" in finding.message
    assert "relayrl deploy scale rollout" in finding.fix and "max_staleness" in finding.fix


def test_a_slow_trainer_is_trainer_bound(tmp_path):
    write_steps(tmp_path, data_wait=0.2, forward=2.0, backward=3.5, optimizer=0.5, publish=0.3, pause=0.1)
    write_driver(tmp_path, held_share=0.8)
    finding = verdict(tmp_path)
    assert finding.level == "warn" and "trainer-bound" in finding.message, finding.message
    assert "91%" in finding.message and "MFU 21.0%" in finding.message and "generation idled 80% of its time" in finding.message
    assert "world_size" in finding.fix
    assert any(line.startswith("driver_stats.jsonl:1-19: idle_s") for line in finding.evidence)


def write_engine_reports(run_dir: pathlib.Path, accelerator: bool) -> None:
    """stages/rollout-<pid>.jsonl as the engine writes them (services/stage_reports.py), idle most of the time."""
    (run_dir / "stages").mkdir(parents=True, exist_ok=True)
    lines = [{"stage/idle_s": 8.0, "stage/decode_s": 2.0, "stage/interval_s": 10.0, "stage/report_time": 1e9 + 10 * i,
              "engine/accelerator": float(accelerator)} for i in range(5)]
    (run_dir / "stages" / "rollout-7.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_slow_trainer_with_engines_on_accelerators_of_their_own_is_trainer_bound(tmp_path):
    write_steps(tmp_path, data_wait=0.2, forward=2.0, backward=3.5, optimizer=0.5, publish=0.3, pause=0.1)
    write_driver(tmp_path, held_share=0.8)
    write_engine_reports(tmp_path, accelerator=True)
    finding = verdict(tmp_path)
    assert finding.level == "warn" and "trainer-bound" in finding.message, finding.message


def test_engines_idling_on_the_trainers_cpu_cores_are_no_bottleneck(tmp_path):
    """The local quickstart's shape on a CPU machine: every service shares its cores, so the time generation waits
    on the trainer is the trainer's (a fresh quickstart run got a trainer-bound WARN before: generation idle 52%)."""
    write_steps(tmp_path, data_wait=0.15, forward=0.3, backward=0.4, optimizer=0.1, publish=0.02, checkpoint=0.02)
    write_driver(tmp_path, held_share=0.6)
    write_engine_reports(tmp_path, accelerator=False)
    finding = verdict(tmp_path)
    assert finding.level == "ok" and "no stage holds the run back" in finding.message, finding.message
    assert "generation idles 60% of its time" in finding.message and "the trainer's" in finding.message


def test_a_busy_trainer_that_generation_keeps_up_with_is_the_steady_state(tmp_path):
    """The quickstart's shape: the trainer computes most of its time, and generation rarely idles."""
    write_steps(tmp_path, data_wait=0.15, forward=0.3, backward=0.4, optimizer=0.1, publish=0.02, checkpoint=0.02)
    write_driver(tmp_path, held_share=0.2)
    finding = verdict(tmp_path)
    assert finding.level == "ok" and "no stage holds the run back" in finding.message, finding.message
    assert "idle 20% of its time" in finding.message


def test_a_healthy_run_is_bound_by_nothing(tmp_path):
    write_steps(tmp_path, data_wait=0.9, forward=0.4, backward=0.5, optimizer=0.1, publish=0.3, pause=0.1,
                checkpoint=0.1)
    finding = verdict(tmp_path)
    assert finding.level == "ok" and "no stage holds the run back" in finding.message, finding.message
    assert not [f for f in diagnose_run(tmp_path) if f.check == "stragglers"]


def test_a_slow_rank_is_a_straggler(tmp_path):
    write_steps(tmp_path, data_wait=0.5, forward=0.4, backward=0.4, optimizer=0.1,
                **{"stage/forward_s/rank1": 0.9, "stage/backward_s/rank1": 0.8, "stage/optimizer_s/rank1": 0.1})
    (straggler,) = [f for f in diagnose_run(tmp_path) if f.check == "stragglers"]
    assert straggler.message.startswith("rank1 computed 19.8s against rank0's 9.9s"), straggler.message
