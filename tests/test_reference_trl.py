"""DPO losses against numbers computed by TRL's own code.

Reference: huggingface/trl at commit f2cd57710ae345ea6428ae95363267fcf38a3dc8 (2026-07-24),
trl/trainer/dpo_trainer.py, DPOTrainer._compute_loss: the section from the log-ratios to the loop over
loss types (f_divergence_type reverse_kl, no label smoothing, no WPO weighting), which
tests/data/reference/generate.py executed as it stands on the pairs stored with the per-pair losses
in tests/data/reference/trl_dpo.json. The pairs have positive, negative, zero and large margins and
completions of 0, 1 and several tokens (IPO divides by them). Agreement in float64 to 1e-6.
"""

import json
import pathlib

import pytest
import torch

from trainer.losses import dpo_loss

COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"
DATA = json.loads((pathlib.Path(__file__).parent / "data" / "reference" / "trl_dpo.json").read_text())
(PAIRS,) = DATA["dpo_losses"]


def f64(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.float64)


def test_the_data_comes_from_the_named_revision():
    assert DATA["reference"] == {"repo": "huggingface/trl", "commit": COMMIT}


@pytest.mark.parametrize("case", PAIRS["cases"], ids=lambda c: f"{c['loss_type']}-{c['beta']}")
def test_dpo_losses_equal_dpo_trainer(case):
    """DPOTrainer._compute_loss, loss_type sigmoid / hinge / ipo: the per-pair losses it averages."""
    losses = dpo_loss(
        f64(PAIRS["chosen"]), f64(PAIRS["rejected"]), f64(PAIRS["ref_chosen"]), f64(PAIRS["ref_rejected"]),
        case["beta"], case["loss_type"], f64(PAIRS["chosen_tokens"]), f64(PAIRS["rejected_tokens"]),
    )  # fmt: skip
    torch.testing.assert_close(losses, f64(case["losses"]), rtol=0, atol=1e-6)
