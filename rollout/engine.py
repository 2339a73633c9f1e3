"""LLMEngine: requests in, tokens (with logprob and weight version) out, one step at a time.

Not thread-safe: one thread calls add_request / abort / step / load_weights (AsyncEngine's loop).
"""

import itertools
import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from rollout.block_manager import BlockManager
from rollout.config import EngineConfig
from rollout.errors import DuplicateRequest, InvalidRequest, QueueFull
from rollout.model_runner import ModelRunner
from rollout.outputs import Completion, RequestOutput, TokenOutput
from rollout.sampling_params import SamplingParams, validate_prompt
from rollout.scheduler import Scheduler
from rollout.sequence import FinishReason, Sequence


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = config.model_config
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, list[Sequence]] = {}
        self.weight_version = 0
        self._seed_rng = random.Random(config.seed)
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self._tokenizer = None

    @property
    def tokenizer(self):
        """The model folder's tokenizer, loaded on first use (stop strings, text in the service)."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        return self._tokenizer

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams) -> None:
        """Queue a request; raises InvalidRequest, DuplicateRequest or QueueFull."""
        prompt = [int(t) for t in prompt_ids]
        validate_prompt(prompt, self.model_config.vocab_size)
        params.validate(
            prompt_len=len(prompt),
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.config.max_model_len,
            max_n=self.config.max_n,
        )
        if self.block_manager.blocks_for(len(prompt) + params.max_tokens) > self.block_manager.num_blocks:
            raise InvalidRequest(
                "params.max_tokens",
                f"prompt + max_tokens ({len(prompt) + params.max_tokens} tokens) exceeds the KV cache "
                f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})",
            )
        if request_id in self.requests:
            raise DuplicateRequest(f"request_id: {request_id!r} is already running")
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are waiting (max_queue={self.config.max_queue})")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(64)
        seqs = [Sequence(next(self._seq_ids), request_id, i, prompt, params, seed) for i in range(params.n)]
        seqs[0].forks = seqs[1:]
        self.scheduler.add(seqs[0])
        self.requests[request_id] = seqs

    def step(self) -> list[TokenOutput]:
        """Schedule, run, post-process: one prefill or decode step. Returns one output per sequence run."""
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        token_ids, logprobs = self.runner.run(batch)
        return self._postprocess(batch.seqs, token_ids, logprobs)

    def abort(self, request_id: str) -> list[TokenOutput]:
        """End a request's unfinished completions (reason abort, partial output kept) and free their blocks."""
        outputs = []
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                seq.finish_reason = FinishReason.ABORT
                self.scheduler.finish(seq)
                outputs.append(TokenOutput(request_id, seq.index, None, None, None, FinishReason.ABORT))
        return outputs

    def compute_logprobs(
        self, prompt_ids: Seq[int], responses: Seq[Seq[int]], temperature: float = 1.0
    ) -> list[list[float]]:
        """Logprob of every token of each response given the prompt and the response tokens before it,
        under softmax(logits / temperature).

        Runs between steps with blocks taken from the free list and returned at once. Raises
        InvalidRequest for bad ids or lengths, QueueFull when running requests hold the blocks needed.
        """
        if not temperature > 0:
            raise InvalidRequest("temperature", f"must be > 0 to score under softmax(logits / temperature), got {temperature}")
        prompt = [int(t) for t in prompt_ids]
        validate_prompt(prompt, self.model_config.vocab_size)
        seqs = []
        for i, response in enumerate(responses):
            tokens = [int(t) for t in response]
            field = f"response_ids[{i}]"
            if tokens:
                validate_prompt(tokens, self.model_config.vocab_size, field)
            if len(prompt) + len(tokens) > self.config.max_model_len:
                raise InvalidRequest(field, f"prompt + response ({len(prompt) + len(tokens)} tokens) exceeds the "
                                            f"context length {self.config.max_model_len}")
            if self.block_manager.blocks_for(len(prompt) + len(tokens)) > self.block_manager.num_blocks:
                raise InvalidRequest(field, f"prompt + response exceeds the KV cache ({self.block_manager.num_blocks} "
                                            f"blocks of {self.block_manager.block_size})")
            seqs.append(Sequence(-1, "", i, prompt + tokens, SamplingParams(), 0))
        results: list[list[float]] = [[] for _ in seqs]
        pending = [seq for seq in seqs if len(seq) > len(prompt)]
        while pending:
            chunk = self._fitting(pending)
            for seq in chunk:
                self.block_manager.allocate(seq)
            try:
                scored = self.runner.score(chunk, [len(prompt)] * len(chunk), temperature)
            finally:
                for seq in chunk:
                    self.block_manager.deallocate(seq)
            for seq, logprobs in zip(chunk, scored):
                results[seq.index] = logprobs
            pending = pending[len(chunk):]
        return results

    def _fitting(self, seqs: list[Sequence]) -> list[Sequence]:
        """The longest head of `seqs` whose blocks are free now and whose tokens fit one prefill."""
        blocks = tokens = count = 0
        for seq in seqs:
            blocks += self.block_manager.blocks_for(len(seq))
            tokens += len(seq)
            if blocks > self.block_manager.num_free_blocks or (count and tokens > self.config.max_num_batched_tokens):
                break
            count += 1
        if count == 0:
            raise QueueFull(f"running requests hold the KV blocks needed to score {len(seqs[0])} tokens; retry")
        return seqs[:count]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def load_weights(
        self, named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int,
        adopt: bool = False,
    ) -> None:
        """Copy tensors into the parameters of the same name, in place, and serve them as `version`.

        With `adopt`, the model serves the given tensors themselves instead (a complete update whose
        memory the caller hands over, see CausalLM.adopt_weights). Sequences in flight keep their KV
        and continue; their later tokens carry the new version.
        """
        items = named_tensors.items() if isinstance(named_tensors, dict) else named_tensors
        with torch.no_grad():
            if adopt:
                self.runner.model.adopt_weights(items)
            else:
                self.runner.model.load_weights(items)
        self.weight_version = version

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """Offline generation: run every prompt to completion, outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        outputs: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, params_list, strict=True):
            request_id = f"generate-{next(self._request_ids)}"
            self.add_request(request_id, prompt, p)
            outputs[request_id] = RequestOutput(request_id, list(prompt), [Completion(i) for i in range(p.n)])
        while any(output.request_id in self.requests for output in outputs.values()):
            for token in self.step():
                if token.request_id in outputs:
                    outputs[token.request_id].completions[token.index].add(token)
        return list(outputs.values())

    @property
    def stats(self) -> dict[str, int]:
        """Gauges for metrics: running and waiting sequences, free KV blocks, preemptions so far."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_blocks": self.block_manager.num_free_blocks,
            "preemptions": self.scheduler.num_preemptions,
        }

    def _postprocess(self, seqs: list[Sequence], token_ids: list[int], logprobs: list[float]) -> list[TokenOutput]:
        outputs = []
        for seq, token_id, logprob in zip(seqs, token_ids, logprobs):
            seq.append(token_id, logprob, self.weight_version)
            reason = self._finish_reason(seq, token_id)
            if reason is not None:
                seq.finish_reason = reason
                self.scheduler.finish(seq)
                if all(s.is_finished for s in self.requests[seq.request_id]):
                    del self.requests[seq.request_id]
            outputs.append(TokenOutput(seq.request_id, seq.index, token_id, logprob, self.weight_version, reason))
        return outputs

    def _finish_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in self.model_config.eos_token_ids):
            return FinishReason.STOP
        if params.stop and self._ends_with_stop_string(seq):
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or len(seq) >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

    def _ends_with_stop_string(self, seq: Sequence) -> bool:
        """Whether the newest token completed a stop string (each token decodes to >= 1 character)."""
        window = max(len(s) for s in seq.params.stop) + 1
        text = self.tokenizer.decode(seq.output_ids[-window:])
        return any(stop in text for stop in seq.params.stop)
