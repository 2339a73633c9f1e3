"""Pipeline parallelism (parallel.pp, trainer/parallel/stages.py and pipeline.py): 2 stages on 2 gloo ranks give
the single process's losses, gradients and updated weights, with the 1F1B and the interleaved schedule; a DCP
checkpoint resumes across pp sizes (2 -> 1, 1 -> 2) at the same next loss; the trained policy, published by both
stages (each its own layers), lands bit for bit in an engine and a rollout process greedy-decodes as the trainer's
model does (test_pipeline_publish.py: the publish path, and a stage whose part never arrives). On 4 ranks (`ranks`):
pp 2 x dp 2, and pp 2 x tp 2 (TP within each stage).

The test runs this file as a script under `torchrun --nproc_per_node 2` (see `worker`). A 4-layer tiny model:
interleaved runs 2 stages per rank.
"""

import argparse
import sys
from pathlib import Path

import pytest
import torch
from test_trainer_parallel import _run, make_samples

STEPS = 2
SAVE_AT = 1  # the checkpoint holds the state after this many steps; a resume trains step SAVE_AT
SCHEDULES = {"1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B",
             "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble"}  # the last not with dp > 1 (refused)
RUNS = {  # micro_batch_size 2 of 8 rows: 4 micro-batches a step, 2 x pp
    "grpo": {"name": "grpo", "off_policy": "tis", "kl_coef": 0.05, "entropy_coef": 0.01},
    "ppo": {"name": "ppo", "off_policy": "decoupled"},
    "dpo": {"name": "dpo"},
}


def _config(model: str, algorithm: dict, pp: int, schedule: str, micro_batch_size: int, tp: int = 1):
    """Adam's eps 1e-4: with the default 1e-8 an entry whose gradient is near 0 moves by lr * g / (|g| + eps), which
    turns a float-rounding difference of 1e-10 in g (stages sum in another order) into 2e-5 in the weight."""
    from trainer.config import TrainerConfig

    return TrainerConfig.model_validate({
        "model_path": model, "ref_model_path": model, "optim": {"lr": 2e-3, "eps": 1e-4},
        "algorithm": algorithm, "batch": {"global_batch_size": 8, "micro_batch_size": micro_batch_size},
        "parallel": {"pp": pp, "pp_schedule": schedule, "tp": tp},
    })  # fmt: skip


def _capture_gradients(learner, env, into: dict) -> None:
    """The whole gradient of every parameter, by name, at the first optimizer step (before it), on rank 0."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    names = {id(p): name for name, p in learner.policy.named_parameters()}
    done = []

    def hook(optimizer, _args, _kwargs):
        if done:
            return
        done.append(True)
        grads = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                    grads[names[id(p)]] = grad.detach().cpu().clone()
        if env.distributed:
            parts = [None] * env.world_size if env.is_main else None
            dist.gather_object(grads, parts, dst=0)
            grads = {k: v for part in parts or [] for k, v in part.items()}
        into.update(grads)

    learner.optimizer.register_step_pre_hook(hook)


def publish_to_engine(model: str, learner, env, engine: str) -> dict | None:
    """The trainer's publish path with stages (test_pipeline_publish.StagePublisher: each stage's rank sends its own
    layers; collective): to a native engine inside rank 0 and to the rollout process at `engine`. On rank 0: whether
    it landed, which tensors the in-process engine serves that differ from the trainer's, and the trainer's weights."""
    from test_pipeline_publish import StagePublisher, differing

    with StagePublisher(model, learner, env, [engine], timeout_s=60) as publisher:
        published = publisher.publish(1)  # a later algorithm's is refused as not newer, and goes out as the next
    if published is None:
        return None
    return {"ok": published["ok"], "failed": published["failed"], "served": len(published["served"]),
            "sent": len(published["trainer"]), "differ": differing(published["served"], published["trainer"]),
            "weights": published["trainer"]}


def train(model: str, env, algorithms: list[str], schedule: str, micro_batch_size: int, *, save: Path | None = None,
          resume: Path | None = None, publish: str | None = None) -> dict:
    """Per algorithm: each step's loss and grad norm, the first step's gradients, the final weights and the
    schedule class that ran; with `resume`: from that checkpoint root, the steps after it; with `publish` (a rollout
    process's address): the final weights published to it and to an in-process engine (publish_to_engine)."""
    from torch.distributed.tensor import DTensor

    from trainer.checkpoint import TrainState, latest_checkpoint, load_checkpoint, save_checkpoint
    from trainer.learner import Learner
    from trainer.parallel import gather_model_state

    results = {}
    for name in algorithms:
        algorithm = RUNS[name]
        learner = Learner(_config(model, algorithm, env.pp_size, schedule, micro_batch_size, env.tp_size), env)
        state = TrainState()
        if resume is not None:
            state = load_checkpoint(latest_checkpoint(resume / name), learner.policy, learner.optimizer, env)
        grads: dict = {}
        _capture_gradients(learner, env, grads)
        samples = make_samples(algorithm["name"])
        steps = []
        while state.step < STEPS:
            for mini_batch in learner.prepare(samples):
                metrics = learner.train_step(mini_batch, state.step)
                steps.append([metrics["loss"], metrics["grad_norm"]])
                state.step += 1
            if save is not None and state.step == SAVE_AT:
                save_checkpoint(save / name, learner.policy, learner.optimizer, state, env)
        pipeline = learner.pipeline
        tp_split = [n for n, p in learner.policy.named_parameters()
                    if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())]
        results[name] = {"tp_split": len(tp_split),"steps": steps, "grads": grads, "weights": gather_model_state(learner.policy, env),
                         "schedule": type(pipeline.last_schedule).__name__ if pipeline else None,
                         "bubble": learner.pipeline and metrics["pp_bubble"],
                         "published": publish_to_engine(model, learner, env, publish) if publish else None}
    return results


def worker(args) -> None:
    """Under torchrun: rank 0 alone trains a world of one (pp 1) first, saving a checkpoint; then every rank with
    pp stages, each schedule (the 1F1B run saving a checkpoint and publishing its weights from both stages), and
    resumes from the pp 1 checkpoint; then rank 0
    alone resumes from the staged checkpoint. One launch: a process's imports cost more than its training."""
    torch.set_num_threads(1)
    from trainer.parallel import DistEnv, init_distributed, shutdown_distributed

    env = init_distributed("cpu", pp=args.pp, tp=args.tp)
    one = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    algorithms, ckpt, mbs = args.algorithms.split(","), Path(args.checkpoints), args.micro_batch_size
    results = {}
    if env.is_main:
        results["single"] = train(args.model, one, algorithms, "1f1b", mbs, save=ckpt / "pp1")
    env.barrier()
    for schedule in args.schedules.split(","):
        results[schedule] = train(args.model, env, algorithms, schedule, mbs,
                                  save=ckpt / "staged" if schedule == "1f1b" else None,
                                  publish=args.engine if schedule == "1f1b" else None)
    results["staged_resumed"] = train(args.model, env, algorithms, "1f1b", mbs, resume=ckpt / "pp1")
    if env.is_main:
        results["single_resumed"] = train(args.model, one, algorithms, "1f1b", mbs, resume=ckpt / "staged")
        torch.save(results, args.out)
    env.barrier()
    shutdown_distributed(env)


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    from rollout.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("pp-model") / "qwen2", num_layers=4, hidden_size=64,
                            num_heads=2, num_kv_heads=1, intermediate_size=96, seed=0)


def _assert_same(staged: dict, single: dict, name: str) -> None:
    steps_pp, steps_one = torch.tensor(staged["steps"]), torch.tensor(single["steps"])
    assert steps_pp.shape == steps_one.shape == (STEPS, 2), name
    torch.testing.assert_close(steps_pp, steps_one, rtol=0, atol=1e-5, msg=name)
    assert abs(single["steps"][-1][0] - single["steps"][0][0]) > 1e-3, f"{name}: the loss does not move"
    for field in ("grads", "weights"):
        assert staged[field].keys() == single[field].keys(), f"{name} {field}"
        for key, tensor in single[field].items():
            torch.testing.assert_close(staged[field][key], tensor, rtol=0, atol=1e-5, msg=f"{name} {field} {key}")


def _run_and_check(model: Path, tmp_path: Path, port: int, algorithms: list[str], engine: str, nproc: int = 2,
                   micro_batch_size: int = 2, schedules: tuple[str, ...] = ("1f1b", "interleaved_1f1b"),
                   tp: int = 1) -> None:
    """`engine`: a rollout process serving `model`, which each 1F1B run publishes to."""
    from test_pipeline_publish import engine_greedy, greedy

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", str(port)]
    _run([*torchrun, str(Path(__file__)), "--model", str(model), "--checkpoints", str(tmp_path / "ckpt"),
          "--out", str(tmp_path / "out.pt"), "--algorithms", ",".join(algorithms), "--micro-batch-size",
          str(micro_batch_size), "--schedules", ",".join(schedules), "--engine", engine, "--tp", str(tp)], tmp_path,
         timeout=600)
    results = torch.load(tmp_path / "out.pt", weights_only=False)
    single = results["single"]
    for schedule in schedules:
        kind = SCHEDULES[schedule]
        for name in algorithms:
            assert results[schedule][name]["schedule"] == kind, (schedule, name)
            assert (results[schedule][name]["tp_split"] > 0) == (tp > 1), (schedule, name)  # rank 0's layers split
            assert 0 <= results[schedule][name]["bubble"] < 1
            _assert_same(results[schedule][name], single[name], f"{schedule} {name}")
    for name in algorithms:  # the staged policy, published by both stages, lands whole and bit-exact
        published = results["1f1b"][name]["published"]
        assert published["ok"] and published["served"] == published["sent"] > 40, published["failed"]
        assert published["differ"] == [], published["differ"]
    # The rollout process serves the last one: its greedy tokens are the trained policy's (transformers, its weights).
    tokens, _ = engine_greedy(engine)
    assert tokens == greedy(model, results["1f1b"][algorithms[-1]]["published"]["weights"])
    for name in algorithms:  # resumed runs train the steps after SAVE_AT: the saving run's next losses
        for got, want in ((results["single_resumed"][name], results["1f1b"][name]),
                          (results["staged_resumed"][name], single[name])):
            assert len(got["steps"]) == STEPS - SAVE_AT
            assert abs(got["steps"][0][0] - want["steps"][SAVE_AT][0]) <= 1e-6, name


def test_two_stages_follow_single_process(four_layers, tmp_path, free_port, service_factory):
    engine = service_factory("rollout", {"model": str(four_layers)})
    _run_and_check(four_layers, tmp_path, free_port, ["grpo"], engine.address)


def test_stages_split_at_layer_boundaries():
    from trainer.config.parallel import ParallelConfig
    from trainer.parallel.stages import stage_layers

    assert stage_layers(7, ParallelConfig(pp=2)) == [range(4), range(4, 7)]  # balanced, the first one longer
    interleaved = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b")  # rank 0: stages 0, 2; rank 1: 1, 3
    assert stage_layers(8, interleaved) == [range(2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layers(8, ParallelConfig(pp=2, pp_split=[3, 5])) == [range(3), range(3, 8)]
    with pytest.raises(ValueError, match="sums to 7, the model has 8 layers"):
        stage_layers(8, ParallelConfig(pp=2, pp_split=[3, 4]))
    with pytest.raises(ValueError, match="2 stages of at least one layer each"):
        ParallelConfig(pp=2, pp_split=[8])
    with pytest.raises(ValueError, match="4 stages need at least as many decoder layers"):
        stage_layers(3, interleaved)


def test_pp_refuses_what_it_cannot_do_yet(tiny_model_dir):
    from trainer.config import TrainerConfig
    from trainer.learner import Learner
    from trainer.parallel import DistEnv

    base = {"model_path": str(tiny_model_dir), "parallel": {"pp": 2}}
    with pytest.raises(ValueError, match="parallel.pp > 1: not with batch.packing yet"):
        TrainerConfig.model_validate({**base, "batch": {"packing": True}})
    with pytest.raises(ValueError, match="pp=2, ep=1, but the process group was made with tp=1, pp=1"):
        Learner(TrainerConfig.model_validate(base), DistEnv(rank=0, world_size=1, device=torch.device("cpu")))


@pytest.mark.ranks
def test_two_stages_ppo_dpo(four_layers, tmp_path, free_port, service_factory):
    engine = service_factory("rollout", {"model": str(four_layers)})
    _run_and_check(four_layers, tmp_path, free_port, ["ppo", "dpo"], engine.address, schedules=tuple(SCHEDULES))


@pytest.mark.ranks
def test_two_stages_two_data_parallel(four_layers, tmp_path, free_port, service_factory):
    """pp 2 x dp 2 (4 processes): each stage's layers FSDP-sharded over 2 ranks, 4 micro-batches of 1 row each
    (DPO's pairs need micro-batches of 2 rows: test_two_stages_ppo_dpo covers it on pp 2)."""
    engine = service_factory("rollout", {"model": str(four_layers)})
    _run_and_check(four_layers, tmp_path, free_port, ["grpo", "ppo"], engine.address, nproc=4, micro_batch_size=1)


@pytest.mark.ranks
def test_two_stages_two_tensor_parallel(tmp_path_factory, tmp_path, free_port, service_factory):
    """pp 2 x tp 2 (4 processes): each stage's layers split by TP (its heads and MLP columns, the residual stream by
    sequence, so a stage sends the next one its share of positions), 4 micro-batches of 2 rows, under 1F1B and
    interleaved 1F1B (2 stages per rank). Two K/V heads: TP splits whole heads."""
    from rollout.model.tiny import write_tiny_model

    model = write_tiny_model(tmp_path_factory.mktemp("pp-tp-model") / "qwen2", num_layers=4, hidden_size=64,
                             num_heads=2, num_kv_heads=2, intermediate_size=96, seed=0)
    engine = service_factory("rollout", {"model": str(model)})
    _run_and_check(model, tmp_path, free_port, ["grpo", "ppo", "dpo"], engine.address, nproc=4, tp=2,
                   schedules=tuple(SCHEDULES))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--algorithms", default="grpo")
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--schedules", default="1f1b,interleaved_1f1b")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--engine", required=True)
    worker(parser.parse_args())
