"""Sequence packing (trainer/packing.py, trainer/varlen.py): samples of any length end to end in rows, positions
restarting per sample, attention confined to each; the forward's outputs, every algorithm's loss and its gradients
equal the padded path's within 1e-6 in float64, through the block mask and through varlen attention."""

import numpy as np
import pytest
import torch

from protos.sample import Sample
from trainer.batch import split_packs
from trainer.config import TrainerConfig
from trainer.learner import Learner
from trainer.model import Packing, load_policy, run_policy
from trainer.packing import assign_rows, pack_by_token_sum, pack_rows
from trainer.parallel import DistEnv
from trainer.varlen import use_varlen


def test_pack_rows_lays_samples_end_to_end_with_restarting_positions():
    ids = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9], [10, 0, 0, 0]])
    rows = pack_rows(ids, [3, 2, 4, 1], row_tokens=5)
    # Longest first, first fit: [c (4) + d (1)], [a (3) + b (2)].
    assert rows.input_ids.tolist() == [[6, 7, 8, 9, 10], [1, 2, 3, 4, 5]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert rows.cu_seqlens.tolist() == [0, 4, 5, 8, 10] and rows.max_seqlen == 4
    per_token = torch.arange(8.0).view(2, 4)  # the packed rows' [R, L - 1] outputs
    assert rows.unpack(per_token).tolist() == [[4, 5, 0], [7, 0, 0], [0, 1, 2], [0, 0, 0]]
    assert rows.spread(torch.tensor([10.0, 20.0, 30.0, 40.0])).tolist() == [[30, 30, 30, 1], [10, 10, 1, 20]]


def test_a_shorter_row_gets_a_padding_segment_of_its_own():
    rows = pack_rows(torch.tensor([[1, 2, 3], [4, 5, 0]]), [3, 2], row_tokens=4)
    assert rows.input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]  # rows as long as the fullest
    assert rows.position_ids.tolist() == [[0, 1, 2], [0, 1, 0]]
    assert rows.cu_seqlens.tolist() == [0, 3, 5, 6]


def test_rows_and_micro_batches_are_filled_first_fit_by_real_tokens():
    assert assign_rows([3, 9, 4, 2], row_tokens=8) == [[1], [2, 0], [3]]
    assert assign_rows([3, 9, 4, 2], row_tokens=None) == [[1, 2, 0, 3]]
    assert pack_by_token_sum([3, 9, 4, 2, 5], budget=10, max_units=3) == [[1], [4, 2], [0, 3]]
    assert pack_by_token_sum([3, 3, 3, 3], budget=100, max_units=3) == [[0, 1, 2], [3]]
    assert split_packs([[0, 1, 2]], [1, 5, 1], 2, packed=True) == [[0], [1, 2]]


@pytest.fixture(scope="module")
def policy64(tiny_model_dir):
    policy = load_policy(tiny_model_dir, value_head=True, chunk_tokens=5).double()
    torch.nn.init.normal_(policy.value_head.weight)
    return policy


@pytest.mark.parametrize("attention", ["mask", "varlen"])
@pytest.mark.parametrize("row_tokens", [None, 12, 3])
def test_packed_forward_equals_the_padded_one(tiny_model_dir, attention, row_tokens):
    policy = load_policy(tiny_model_dir, value_head=True, chunk_tokens=5).double()
    torch.nn.init.normal_(policy.value_head.weight)
    lengths = [5, 9, 3, 7, 2]
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 90, (5, 9), generator=g)
    mask = (torch.arange(9) < torch.tensor(lengths)[:, None]).long()
    columns = mask[:, 1:].double()
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5])
    upstream = torch.randn(3, 5, 8, generator=g, dtype=torch.float64) * columns

    def forward(packing):
        policy.zero_grad()
        out = run_policy(policy, ids, mask, temps, entropy_grad=True, packing=packing)
        ((out.logprobs * upstream[0]).sum() + (out.entropy * upstream[1]).sum() + (out.values * upstream[2]).sum()).backward()
        grads = {name: p.grad.clone() for name, p in policy.named_parameters()}
        return [x * columns for x in (out.logprobs, out.entropy, out.values)], grads

    padded, padded_grads = forward(None)
    if attention == "varlen":
        use_varlen(policy.lm)  # on CPU: one causal attention per segment
    packed, packed_grads = forward(Packing(row_tokens))
    for mine, theirs in zip(packed, padded, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, atol=1e-6, rtol=0, msg=name)


def samples_of_any_length(count=8, pairs=False, seed=5) -> list[Sample]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        prompt_len, response_len = 1 + (5 * i) % 7, 1 + (3 * i) % 11
        loss_mask = np.ones(response_len, dtype=np.uint8)
        loss_mask[0] = i % 3 != 0  # some responses start with an environment token
        samples.append(Sample(
            sample_id=f"s{i}", prompt_id=f"p{i // 2 if pairs else i // 4}", group_size=2 if pairs else 4,
            prompt_ids=np.r_[1, rng.integers(3, 90, prompt_len - 1)].astype(np.int32),
            response_ids=rng.integers(3, 90, response_len).astype(np.int32),
            loss_mask=loss_mask, rollout_logprobs=rng.uniform(-5, -3, response_len).astype(np.float32),
            weight_versions=np.zeros(response_len, dtype=np.int64),
            reward=float(i % 2) if pairs else float(rng.integers(0, 4)), temperature=0.8 if i % 2 else 1.0,
        ))
    return samples


def float64_step(model_dir, algorithm: dict, batch: dict, samples) -> tuple[float, dict[str, torch.Tensor]]:
    """One train_step in float64: (loss, gradients before the optimizer step)."""
    config = TrainerConfig.model_validate({
        "model_path": str(model_dir), "ref_model_path": str(model_dir), "algorithm": algorithm,
        "optim": {"max_grad_norm": None}, "model": {"logprob_chunk_tokens": 6},
        "batch": {"global_batch_size": len(samples), **batch},
    })
    learner = Learner(config, DistEnv(rank=0, world_size=1, device=torch.device("cpu")))
    for model in filter(None, (learner.policy, learner.reference)):
        model.double()
    if learner.policy.value_head is not None:
        torch.nn.init.normal_(learner.policy.value_head.weight, std=0.1)
    learner.optimizer.step = learner.optimizer.zero_grad = lambda *args, **kwargs: None
    (mini_batch,) = learner.prepare(samples)
    metrics = learner.train_step(mini_batch, 0)
    return metrics["loss"], {name: p.grad for name, p in learner.policy.named_parameters() if p.grad is not None}


ALGORITHMS = {
    "sft": {"name": "sft"},
    "grpo": {"name": "grpo", "entropy_coef": 0.01},
    "grpo-recompute": {"name": "grpo", "off_policy": "tis", "kl_coef": 0.1},
    "ppo": {"name": "ppo"},
    "dpo": {"name": "dpo"},
}


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("attention", ["mask", "varlen"])
def test_packed_losses_and_gradients_equal_the_padded_path(tiny_model_dir, name, attention):
    samples = samples_of_any_length(pairs=name == "dpo")
    padded = float64_step(tiny_model_dir, ALGORITHMS[name], {"micro_batch_size": 4}, samples)
    packed = float64_step(tiny_model_dir, ALGORITHMS[name], {
        "micro_batch_size": 4, "packing": True, "packed_attention": attention, "max_tokens_per_micro_batch": 30,
    }, samples)
    assert packed[0] == pytest.approx(padded[0], abs=1e-6)
    assert set(packed[1]) == set(padded[1])
    for param, grad in padded[1].items():
        torch.testing.assert_close(packed[1][param], grad, atol=1e-6, rtol=0, msg=param)


def test_micro_batches_by_real_tokens_for_every_algorithm(tiny_model_dir):
    """With packing the token budget counts what the packed rows hold: fewer micro-batches than padded ones."""
    samples = samples_of_any_length(count=16, pairs=True)
    lengths = [s.prompt_ids.size + s.response_ids.size for s in samples]
    for packing in (False, True):
        config = TrainerConfig.model_validate({
            "model_path": str(tiny_model_dir), "algorithm": {"name": "dpo"}, "ref_model_path": str(tiny_model_dir),
            "batch": {"global_batch_size": 16, "micro_batch_size": 16, "max_tokens_per_micro_batch": 40,
                      "packing": packing},
        })
        learner = Learner(config, DistEnv(rank=0, world_size=1, device=torch.device("cpu")))
        (mini_batch,) = learner.prepare(samples)
        rows = learner._micro_rows(mini_batch)
        for index in rows:  # a (chosen, rejected) pair stays together
            assert sorted(index.tolist()) == sorted({2 * (i // 2) + j for i in index.tolist() for j in (0, 1)})
        real = [int(mini_batch.attention_mask[index].sum()) for index in rows]
        if packing:
            assert max(real) <= 40 or len(rows[real.index(max(real))]) == 2
            packed_count = len(rows)
        else:
            padded_count = len(rows)
    assert packed_count < padded_count
    assert sum(lengths) <= 40 * packed_count
