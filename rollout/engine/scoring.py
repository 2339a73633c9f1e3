"""Scoring given tokens (LLMEngine.compute_logprobs, compute_top_logprobs): one prefill over the prompt and each
response, between steps, with blocks taken from the free list and returned at once, under the newest weights."""

from collections.abc import Sequence as Seq

from rollout.engine.errors import InvalidRequest, QueueFull
from rollout.engine.multimodal import ImageInput, prompt_images
from rollout.engine.sampling_params import SamplingParams, validate_prompt
from rollout.engine.sequence import Sequence


class Scoring:
    """What LLMEngine scores with; it has `config`, `model_config`, `block_manager`, `sessions`, `runner` and
    `weight_version`."""

    def compute_logprobs(
        self, prompt_ids: Seq[int], responses: Seq[Seq[int]], temperature: float = 1.0, images: Seq[ImageInput] = ()
    ) -> list[list[float]]:
        """Logprob of every token of each response given the prompt and the response tokens before it,
        under softmax(logits / temperature).

        Runs between steps with blocks taken from the free list and returned at once (the prefix cache is
        neither read nor filled). Raises
        InvalidRequest for bad ids or lengths, QueueFull when running requests hold the blocks needed.
        """
        return [logprobs for logprobs, _ in self._score(prompt_ids, responses, temperature, 0, images)]

    def compute_top_logprobs(
        self, prompt_ids: Seq[int], response_ids: Seq[int], temperature: float, top: int
    ) -> list[list[tuple[int, float]]]:
        """At each position of the response, the `top` most likely tokens (id, logprob) given the prompt and the
        response tokens before it, under softmax(logits / temperature); one scoring pass like compute_logprobs."""
        return self._score(prompt_ids, [response_ids], temperature, top)[0][1]

    def _score(
        self, prompt_ids: Seq[int], responses: Seq[Seq[int]], temperature: float, top: int,
        images: Seq[ImageInput] = (),
    ) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
        if not temperature > 0:
            raise InvalidRequest("temperature", f"must be > 0 to score under softmax(logits / temperature), got {temperature}")
        prompt = [int(t) for t in prompt_ids]
        validate_prompt(prompt, self.model_config.vocab_size)
        multimodal = prompt_images(self.model_config, prompt, list(images))  # the prompt's images (their positions)
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
            seqs[-1].policy_version = self.weight_version
            seqs[-1].multimodal = multimodal
        results: list[tuple[list[float], list[list[tuple[int, float]]]]] = [([], []) for _ in seqs]
        pending = [seq for seq in seqs if len(seq) > len(prompt)]
        while pending:
            chunk = self._fitting(pending)
            for seq in chunk:
                self.block_manager.allocate(seq, reuse_prefix=False)  # runner.score computes every token
            try:
                scored = self.runner.score(chunk, [len(prompt)] * len(chunk), temperature, top)
            finally:
                for seq in chunk:
                    self.block_manager.deallocate(seq)
            for seq, result in zip(chunk, scored):
                results[seq.index] = result
            pending = pending[len(chunk):]
        return results

    def _fitting(self, seqs: list[Sequence]) -> list[Sequence]:
        """The longest head of `seqs` whose blocks are free now and whose tokens fit one prefill."""
        blocks = tokens = count = 0
        for seq in seqs:
            blocks += self.block_manager.blocks_for(len(seq))
            tokens += len(seq)
            while blocks > self.block_manager.num_free_blocks and self.sessions.evict_idle():
                pass
            if blocks > self.block_manager.num_free_blocks or (count and tokens > self.config.max_num_batched_tokens):
                break
            count += 1
        if count == 0:
            raise QueueFull(f"running requests hold the KV blocks needed to score {len(seqs[0])} tokens; retry")
        return seqs[:count]
