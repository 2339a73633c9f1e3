"""The vLLM worker extension (`worker_extension_cls`): methods vLLM mixes into each of its workers, called by
`collective_rpc` (rollout/engines/vllm_engine.py).

Imported inside vLLM's worker process, so it imports nothing of vLLM's at module level.
"""

from collections.abc import Sequence

import torch


class WeightLoader:
    """Loads a weight update in place into the worker's model."""

    def load_tensors(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named tensors into the served model, through the worker's reload_weights, which runs
        vLLM's post-load processing again (on CPU it repacks linear weights; a plain model.load_weights leaves
        them stale there)."""
        self.reload_weights(weights_iterator=iter(named_tensors))
