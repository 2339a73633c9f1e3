"""The same seed gives the same run start (issue 33 item 3): two processes that warm up one model on one seed write the
same SFT weights and measure the same start metric, and one model measured twice gives the same start metric.

The two processes differ in what a machine does not promise alike: their hash seed, and when the lease book's ack
thread runs (tests/warmup_member.py --late-acks: each ack lands only once the loop has taken the next batch). Before
trainer.dataset.DatasetSource handed each pass's samples out under ids of their own, a sample drawn again right after
it was trained was skipped as a redelivery whenever its ack had not landed yet: the algorithm examples' 550-step
warm-up ended at 0.505 or 0.285 held-out from one seed, its losses apart from step 461."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_each_pass_over_the_data_hands_its_samples_out_under_ids_of_its_own():
    """The lease book skips an id it holds as trained and not yet acked: a sample drawn again in the next pass is a new
    one. The first pass's ids are the samples' own."""
    from deploy.experiment.warmup import sft_sample
    from trainer.dataset import DatasetSource

    source = DatasetSource([sft_sample(str(i), [1, 5], [6, 2]) for i in range(3)], seed=0)
    ids = [sample.sample_id for _ in range(3) for sample in source.pull(2).samples]
    assert sorted(ids[:3]) == ["sft/0", "sft/1", "sft/2"]
    assert sorted(ids[3:]) == ["sft/0@1", "sft/1@1", "sft/2@1"]
    assert len(set(ids)) == 6


def _start(model: pathlib.Path, out: pathlib.Path, hash_seed: str, *flags: str) -> dict:
    """tests/warmup_member.py in a process of its own: its warm-up's weights and start metric."""
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "warmup_member.py"), str(model), str(out), *flags],
                          capture_output=True, text=True, env=env, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def starts(tiny_model_dir, tmp_path_factory) -> tuple[dict, dict]:
    """Two processes of one seed: hash seeds 1 and 2, the second with its acks late."""
    folder = tmp_path_factory.mktemp("warmup-starts")
    return (_start(tiny_model_dir, folder / "first", "1"),
            _start(tiny_model_dir, folder / "second", "2", "--late-acks"))


def test_two_processes_of_one_seed_write_the_same_warm_up_and_start_metric(starts):
    first, second = starts
    assert first["trained"] == second["trained"] == [4] * 8, (first["trained"], second["trained"])
    assert first["sha256"] == second["sha256"]
    assert first["start"] == second["start"]


def test_one_model_measured_twice_gives_the_same_start_metric(starts):
    for start in starts:
        assert start["start"] == start["start_again"]
        assert len(start["start"][1]) == 8 and all(start["start"][1])  # every held-out prompt got a completion
