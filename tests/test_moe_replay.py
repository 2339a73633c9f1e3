"""Routing replay (R3) in the trainer on a tiny Qwen3-MoE: a replayed forward runs exactly the rollout's experts, its
gates are the router's probabilities at them (so `router.weight.grad` is nonzero), padded and packed forwards replay
alike, the routes survive collation, the data-parallel split and micro-batching, and every step reports the MoE
metrics (router agreement from the trainer's own top-k even under replay, expert load, the load-balancing loss)."""

import json

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from deploy.inspect.status_table import _caption, trainer_summary
from protos.sample import Sample
from rollout.model.tiny import write_tiny_model
from trainer.batch import collate, local_rows, pad_rows, plan_mini_batches
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.model import Packing, load_policy, run_policy
from trainer.moe.metrics import MoeStats
from trainer.parallel import DistEnv

LAYERS, TOP_K, EXPERTS = 2, 2, 4  # sparse layers (of 3: the middle one dense), experts per token, experts


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("moe") / "m", arch="qwen3_moe", seed=7, num_layers=3,
                            mlp_only_layers=(1,), hidden_size=64, num_heads=2, num_kv_heads=1)


@pytest.fixture(scope="module")
def policy(moe_dir):
    return load_policy(moe_dir)


def random_routes(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """[..., LAYERS, TOP_K] distinct experts per token and layer."""
    scores = torch.rand(*shape, LAYERS, EXPERTS, generator=torch.Generator().manual_seed(seed))
    return scores.argsort(-1)[..., :TOP_K]


def experts_seen(policy) -> list[torch.Tensor]:
    """Hooks that record the experts each MoE layer's Qwen3MoeExperts is asked to run (filled by each forward)."""
    seen: list[torch.Tensor] = []
    for module in policy.lm.modules():
        if type(module).__name__ == "Qwen3MoeExperts":
            module.register_forward_pre_hook(lambda _, args: seen.append(args[1].detach().clone()))
    return seen


def test_a_replayed_forward_runs_the_rollouts_experts_and_the_router_learns(moe_dir):
    policy = load_policy(moe_dir)
    seen = experts_seen(policy)
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    routes = random_routes((2, 9), seed=2)
    routes[:, -1] = -1  # no rollout route: the router's own choice
    out = run_policy(policy, ids, mask, routes=routes, replay=True)
    hooks = policy.router_hooks
    for layer in range(LAYERS):
        run, wanted, own = seen[layer], routes[:, :, layer].reshape(-1, TOP_K), hooks.own[layer]
        routed = wanted[:, 0] >= 0
        assert torch.equal(run[routed], wanted[routed]) and torch.equal(run[~routed], own[~routed])
        assert not torch.equal(run, own)  # the replay changed what ran
        probs = torch.softmax(hooks.logits[layer].detach(), -1).gather(-1, run)
        assert torch.allclose(probs / probs.sum(-1, keepdim=True), hooks.gates[layer])
    (out.logprobs * mask[:, 1:]).sum().backward(retain_graph=True)
    for router in hooks.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
        router.weight.grad = None
    aux = MoeStats(hooks).add()  # the load-balancing loss reaches the routers too
    aux.backward()
    assert aux.item() > 0 and all(router.weight.grad.abs().sum() > 0 for router in hooks.routers)


def test_replaying_the_routers_own_choice_changes_nothing_and_packing_replays_alike(policy):
    ids = torch.randint(3, 90, (3, 8), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0
    mask[2, 3:] = 0
    with torch.no_grad():
        plain = run_policy(policy, ids, mask).logprobs
        own = torch.stack(policy.router_hooks.own, dim=1).view(3, 8, LAYERS, TOP_K)
        same = run_policy(policy, ids, mask, routes=own, replay=True).logprobs
        routes = random_routes((3, 8), seed=4)
        padded = run_policy(policy, ids, mask, routes=routes, replay=True).logprobs
        packed = run_policy(policy, ids, mask, routes=routes, replay=True, packing=Packing(row_tokens=None)).logprobs
    columns = mask[:, 1:].bool()
    assert torch.allclose(same, plain, atol=1e-6)
    assert torch.allclose(packed[columns], padded[columns], atol=1e-5)
    assert (padded - plain)[columns].abs().max() > 1e-3  # the replayed routes matter


def make_samples(count: int, seed: int = 5) -> list[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        prompt, response = 2 + i % 3, 2 + (5 * i) % 7
        total = prompt + response
        routes = random_routes((total - 1,), seed=100 + i).numpy().astype(np.uint8)
        samples.append(Sample(
            sample_id=f"s{i}", prompt_id=f"p{i // 2}", group_size=2,
            prompt_ids=np.r_[1, rng.integers(3, 90, prompt - 1)].astype(np.int32),
            response_ids=rng.integers(3, 90, response).astype(np.int32),
            loss_mask=np.ones(response, np.uint8), rollout_logprobs=np.full(response, -4.0, np.float32),
            weight_versions=np.zeros(response, np.int64), reward=float(i % 2), routed_experts=routes))
    return samples


def test_routes_survive_the_wire_collation_the_data_parallel_split_and_micro_batches():
    samples = [Sample.from_proto(s.to_proto()) for s in make_samples(7)]
    by_tokens = {tuple(np.r_[s.prompt_ids, s.response_ids]): s for s in samples}
    batch = collate(samples)
    chunks, per_step = plan_mini_batches(batch.num_rows, 2, world_size=2)
    batch = pad_rows(batch, chunks, per_step)  # 7 samples in 2 steps of 4 rows: one padding row
    checked = 0
    for rank in range(2):
        local = batch.select(local_rows(len(chunks), per_step, dp_size=2, dp_rank=rank))
        for start in range(0, local.num_rows, 1):
            micro = local.select(slice(start, start + 1)).trimmed()
            length = int(micro.attention_mask.sum())
            sample = by_tokens[tuple(micro.input_ids[0, :length].tolist())]
            routes = micro.routed_experts[0]
            assert torch.equal(routes[: length - 1], torch.from_numpy(sample.routed_experts.astype(np.int16)))
            assert (routes[length - 1 :] == -1).all()  # the last token and padding: no route
            checked += 1
    assert checked == 8


def trainer_config(model, **fields) -> TrainerConfig:
    base = {"model_path": str(model), "optim": {"lr": 1e-3}, "batch": {"global_batch_size": 4, "micro_batch_size": 2},
            "algorithm": {"name": "grpo"}}
    return TrainerConfig.model_validate({**base, **fields})


def test_every_step_reports_router_agreement_expert_load_and_the_balancing_loss(moe_dir, tmp_path):
    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    learner = Learner(trainer_config(moe_dir, moe={"routing_replay": "rollout", "aux_loss_coef": 0.01}), env)
    samples = make_samples(4)
    batch = collate(samples)
    with torch.no_grad():  # the routes the policy itself would pick: the rollout ran these weights
        run_policy(learner.policy, batch.input_ids, batch.attention_mask)
    own = torch.stack(learner.policy.router_hooks.own, 1).view(*batch.input_ids.shape, LAYERS, TOP_K)
    for sample, row in zip(samples, own):
        sample.routed_experts = row[: sample.prompt_ids.size + sample.response_ids.size - 1].numpy().astype(np.uint8)
    (mini_batch,) = learner.prepare(samples)
    metrics = learner.train_step(mini_batch, 0)
    assert metrics["moe/router_agreement"] == 1.0
    assert 0.5 < metrics["moe/aux_loss"] <= EXPERTS / TOP_K  # 1 when balanced, E / k when k experts take all
    assert metrics["moe/load_max_over_mean"] >= 1.0
    assert {f"moe/load_max_over_mean/{layer}" for layer in range(LAYERS)} <= set(metrics)
    assert REGISTRY.get_sample_value("relayrl_trainer_moe", {"stat": "router_agreement"}) == 1.0
    (tmp_path / "trainer_metrics.jsonl").write_text(json.dumps({"step": 0, "weight_version": 0, **metrics}) + "\n")
    caption = _caption(trainer_summary(tmp_path))
    assert "MoE router agreement 1; expert load max/mean" in caption and "load-balancing loss" in caption
    random = make_samples(4)  # routes drawn at random: the routers agree on about 1 pair in 6
    (mini_batch,) = learner.prepare(random)
    assert learner.train_step(mini_batch, 1)["moe/router_agreement"] < 0.6


def test_replay_refuses_a_sample_without_routes(moe_dir):
    env = DistEnv(rank=0, world_size=1, device=torch.device("cpu"))
    learner = Learner(trainer_config(moe_dir, moe={"routing_replay": "rollout"}), env)
    samples = make_samples(4)
    samples[2].routed_experts = Sample.routed_experts_unset()
    with pytest.raises(ValueError, match="sample s2 carries no routed_experts.*vLLM and SGLang"):
        learner.prepare(samples)


def test_the_experiment_file_turns_replay_on_and_refuses_an_engine_without_routes(tmp_path):
    import pathlib

    import yaml

    from deploy.experiment.schema import ExperimentConfig
    from deploy.rl.plan import pipeline_plan

    folder = pathlib.Path(__file__).resolve().parents[1] / "deploy" / "experiment"
    raw = yaml.safe_load((folder / "quickstart_experiment.yaml").read_text())
    raw["training"] = {**raw.get("training", {}), "routing_replay": "rollout"}
    config = ExperimentConfig.model_validate(raw)
    plan = pipeline_plan(config, tmp_path, tmp_path / "policy", tmp_path / "prompts.jsonl")
    assert plan.trainer["moe"] == {"routing_replay": "rollout"}
    raw["services"] = {"rollout": {"settings": {"engine.type": "vllm"}}}
    with pytest.raises(ValueError, match="routing_replay: rollout, but the vllm rollout engine"):
        ExperimentConfig.model_validate(raw)
