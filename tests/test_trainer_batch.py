"""Samples -> padded tensors, and the policy's per-token logprobs at the right positions."""

import numpy as np
import pytest
import torch

from protos.sample import Sample
from trainer.batch import collate, order_preference_pairs


def sample(sample_id, prompt, response, *, mask=None, logprobs=None, versions=None, group="g", reward=0.0, ref=None):
    n = len(response)
    return Sample(
        sample_id=sample_id,
        prompt_id=group,
        prompt_ids=np.array(prompt, dtype=np.int32),
        response_ids=np.array(response, dtype=np.int32),
        loss_mask=np.array(mask if mask is not None else [1] * n, dtype=np.uint8),
        rollout_logprobs=np.array(logprobs if logprobs is not None else [-1.0] * n, dtype=np.float32),
        weight_versions=np.array(versions if versions is not None else [0] * n, dtype=np.int64),
        reward=reward,
        ref_logprobs=np.array(ref if ref is not None else [], dtype=np.float32),
    )


def test_collate_aligns_response_tokens_to_next_token_columns():
    batch = collate(
        [
            sample("a", [1, 5, 6], [7, 8], mask=[1, 0], logprobs=[-0.1, -0.2], versions=[3, 4], group="p0", reward=1.0),
            sample("b", [1], [9, 10, 11], group="p1"),
            sample("c", [1, 4], [12], group="p0"),
        ]
    )
    assert batch.input_ids.tolist() == [[1, 5, 6, 7, 8], [1, 9, 10, 11, 0], [1, 4, 12, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
    # Column c concerns input_ids[:, c + 1]: response token j of a prompt of length P sits at P - 1 + j.
    assert batch.loss_mask.tolist() == [[0, 0, 1, 0], [1, 1, 1, 0], [0, 1, 0, 0]]
    torch.testing.assert_close(batch.rollout_logprobs[0], torch.tensor([0, 0, -0.1, -0.2]))
    assert batch.versions[0].tolist() == [-1, -1, 3, 4]
    assert batch.group_index.tolist() == [0, 1, 0]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0]
    assert batch.ref_logprobs is None


def test_select_and_trim_keep_fields_aligned():
    batch = collate([sample("a", [1, 5, 6], [7, 8]), sample("b", [1], [9])])
    second = batch.select(slice(1, 2)).trimmed()
    assert second.input_ids.tolist() == [[1, 9]]
    assert second.loss_mask.tolist() == [[1]]
    assert second.rewards.shape == (1,)


def test_collate_rejects_empty_prompt_and_partial_reference():
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        collate([sample("a", [], [7])])
    with pytest.raises(ValueError, match="sample b: ref_logprobs missing"):
        collate([sample("a", [1], [7], ref=[-0.5]), sample("b", [1], [8])])
    with_ref = collate([sample("a", [1, 2], [7], ref=[-0.5]), sample("b", [1], [8, 9], ref=[-0.1, -0.2])])
    torch.testing.assert_close(with_ref.ref_logprobs, torch.tensor([[0.0, -0.5], [-0.1, -0.2]]))


def test_preference_pairs_put_the_higher_reward_first():
    ordered = order_preference_pairs(
        [sample("r1", [1], [2], group="x", reward=0.0), sample("c1", [1], [3], group="x", reward=1.0),
         sample("c2", [1], [4], group="y", reward=2.0), sample("r2", [1], [5], group="y", reward=-1.0)]
    )
    assert [s.sample_id for s in ordered] == ["c1", "r1", "c2", "r2"]
    with pytest.raises(ValueError, match="group z: DPO needs 2 samples with different rewards"):
        order_preference_pairs([sample("a", [1], [2], group="z", reward=1.0), sample("b", [1], [3], group="z", reward=1.0)])


def test_policy_logprobs_match_a_plain_forward_of_each_sequence(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from trainer.model import load_policy, run_policy

    torch.manual_seed(0)
    samples = [sample("a", [1, 40, 41, 42], [50, 51, 52]), sample("b", [1, 60], [70, 71, 72, 73, 74, 75])]
    batch = collate(samples)
    policy = load_policy(tiny_model_dir, value_head=True)
    with torch.no_grad():
        out = run_policy(policy, batch.input_ids, batch.attention_mask)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for row, s in enumerate(samples):
        ids = torch.tensor(np.concatenate([s.prompt_ids, s.response_ids]), dtype=torch.int64)[None]
        with torch.no_grad():
            log_probs = torch.log_softmax(reference(ids).logits[0].float(), dim=-1)
        prompt_len = s.prompt_ids.size
        expected = torch.stack([log_probs[prompt_len - 1 + j, t] for j, t in enumerate(s.response_ids.tolist())])
        got = out.logprobs[row][batch.loss_mask[row] > 0]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    assert out.values.shape == batch.loss_mask.shape
    assert (out.values == 0).all()  # the critic starts at zero
    assert out.entropy.shape == batch.loss_mask.shape and (out.entropy > 0).all()
