"""The vLLM worker extension (`worker_extension_cls`): methods vLLM mixes into each of its workers, called by
`collective_rpc` (rollout/engines/vllm_engine.py).

Imported inside vLLM's worker process, so it imports nothing of vLLM's at module level.

Tempered scoring: vLLM computes prompt logprobs from the raw logits whatever its logprobs_mode (prompt tokens
skip the sampling processors). A scoring request that names a temperature in its SamplingParams.extra_args
(SCORE_TEMPERATURE) gets log softmax(logits / T) instead: while the worker computes a step's prompt logprobs,
the model's compute_logits divides each row of that request by T. So a score at T asks for prompt_logprobs=0
(the given token's logprob) or its top few, never the whole vocabulary.
"""

from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch

SCORE_TEMPERATURE = "relayrl_score_temperature"


class WeightLoader:
    """Loads weight updates in place into the worker's model, and scores prompts at a temperature."""

    def load_tensors(self, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named tensors into the served model, through the worker's reload_weights, which runs
        vLLM's post-load processing again (on CPU it repacks linear weights; a plain model.load_weights leaves
        them stale there)."""
        self.reload_weights(weights_iterator=iter(named_tensors))

    def enable_tempered_prompt_logprobs(self) -> str:
        """Make prompt logprobs honour SCORE_TEMPERATURE (once per worker); returns the model runner it hooked:
        'v1' (vLLM's GPUModelRunner and the CPU build's) or 'v2' (vLLM's Model Runner V2)."""
        runner = self.model_runner
        if getattr(runner, "_relayrl_tempered", None):
            return runner._relayrl_tempered
        if hasattr(runner, "_get_prompt_logprobs_dict"):
            runner._relayrl_tempered = _hook_v1(runner)
        elif getattr(runner, "prompt_logprobs_worker", None) is not None:
            runner._relayrl_tempered = _hook_v2(runner.prompt_logprobs_worker)
        else:
            raise RuntimeError(f"{type(runner).__name__}: no prompt-logprob step known to relayrl's tempered scoring")
        return runner._relayrl_tempered


def _hook_v1(runner) -> str:
    """GPUModelRunner._get_prompt_logprobs_dict(hidden_states, num_scheduled_tokens) calls
    model.compute_logits once per prompt-logprob request, on its rows of hidden_states."""
    original = runner._get_prompt_logprobs_dict

    def prompt_logprobs(hidden_states: torch.Tensor, num_scheduled_tokens: dict[str, int]):
        spans = []
        for req_id in runner.num_prompt_logprobs:
            temperature = _temperature(runner.requests[req_id].sampling_params)
            index = runner.input_batch.req_id_to_index.get(req_id)
            if temperature != 1.0 and index is not None and req_id in num_scheduled_tokens:
                starts = runner.query_start_loc.np
                spans.append((int(starts[index]), int(starts[index + 1]), temperature))
        if not spans:
            return original(hidden_states, num_scheduled_tokens)
        with _tempered_logits(runner.model, hidden_states, spans):
            return original(hidden_states, num_scheduled_tokens)

    runner._get_prompt_logprobs_dict = prompt_logprobs
    return "v1"


def _hook_v2(worker) -> str:
    """Model Runner V2's PromptLogprobsWorker.compute_prompt_logprobs(logits_fn, hidden_states, input_batch, ...)
    computes the logits of the batch's rows in chunks through logits_fn. Written against vLLM 0.32; not run
    here (the CPU build runs the v1 runner)."""
    temperatures: dict[str, float] = {}
    add, remove, compute = worker.add_request, worker.remove_request, worker.compute_prompt_logprobs

    def add_request(req_id, req_idx, sampling_params):
        temperatures[req_id] = _temperature(sampling_params)
        return add(req_id, req_idx, sampling_params)

    def remove_request(req_id):
        temperatures.pop(req_id, None)
        return remove(req_id)

    def compute_prompt_logprobs(logits_fn, hidden_states, input_batch, *args, **kwargs):
        starts = input_batch.query_start_loc_np
        spans = [(int(starts[i]), int(starts[i + 1]), temperatures[req_id])
                 for i, req_id in enumerate(input_batch.req_ids) if temperatures.get(req_id, 1.0) != 1.0]
        if spans:
            logits_fn = _divided(logits_fn, hidden_states, spans)
        return compute(logits_fn, hidden_states, input_batch, *args, **kwargs)

    worker.add_request, worker.remove_request = add_request, remove_request
    worker.compute_prompt_logprobs = compute_prompt_logprobs
    return "v2"


def _temperature(sampling_params) -> float:
    """The scoring temperature a request names (1 for every other request, pooling ones included)."""
    extra_args = getattr(sampling_params, "extra_args", None) or {}
    return float(extra_args.get(SCORE_TEMPERATURE, 1.0))


@contextmanager
def _tempered_logits(model, hidden_states: torch.Tensor, spans: list[tuple[int, int, float]]):
    """model.compute_logits divides the rows in `spans` (of hidden_states) by their temperature, for the
    duration (an instance attribute shadows the method, then goes)."""
    original, shadowed = model.compute_logits, "compute_logits" in vars(model)
    model.compute_logits = _divided(original, hidden_states, spans)
    try:
        yield
    finally:
        if shadowed:
            model.compute_logits = original
        else:
            del model.compute_logits


def _divided(logits_fn: Callable[[torch.Tensor], torch.Tensor], hidden_states: torch.Tensor,
             spans: list[tuple[int, int, float]]) -> Callable[[torch.Tensor], torch.Tensor]:
    """logits_fn whose rows in `spans` come out divided by the span's temperature, in float32. Its argument is
    a slice of hidden_states' rows (a view): where it starts says which rows they are."""
    divisors = torch.ones(hidden_states.shape[0], dtype=torch.float32, device=hidden_states.device)
    for start, end, temperature in spans:
        divisors[start:end] = temperature
    row_bytes = hidden_states.stride(0) * hidden_states.element_size()

    def logits(rows: torch.Tensor) -> torch.Tensor:
        first, rest = divmod(rows.data_ptr() - hidden_states.data_ptr(), row_bytes)
        if rest or not 0 <= first <= hidden_states.shape[0] - rows.shape[0]:
            raise RuntimeError("prompt-logprob rows are not a slice of the step's hidden states")
        return logits_fn(rows).float() / divisors[first:first + rows.shape[0], None]

    return logits
