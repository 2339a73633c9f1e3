"""Hand a prefilled request from one engine to another: export its prompt KV and first tokens, import them.

`prefill_for_transfer` (prefill worker) runs between two steps, like compute_logprobs: it takes blocks for
the prompt, runs one prefill batch built exactly as the scheduler builds one for a new request (completion
0 computed, the other n - 1 sampling from its logits with their own seed and index), exports the prompt's
KV and frees the blocks. The n completions are prefilled once. A prompt with images (a vision-language model) runs
the vision tower there, and the export carries the prompt's M-RoPE positions and the offset decoding continues them
with (rollout/engine/multimodal.py).

`prefill_many_for_transfer` does that for the prefill worker's concurrent requests in one batch.

`add_prefilled_request` (decode worker) makes the request's n sequences, imports the KV into the blocks of
completion 0, lets the others share them (fork) and appends each completion's first token, as the
monolithic engine's postprocess does. With images, the request keeps them (a preempted request recomputes its prompt,
tower included) and the positions the transfer carries, checked against those its images give the prompt. Each then holds a private block for the slot of its first token
(copy-on-write of the shared last block) and waits in the scheduler like a session turn that brings its
blocks: every token cached but the first sampled one, which its next step feeds in. From there the engine
cannot tell it from a request it prefilled itself (preemption recomputes it from its tokens, as any other).

Both run on the engine thread only (AsyncEngine commands). They reuse the engine's bookkeeping
(`_new_sequences`, `step_stats.batch`, `_postprocess`) rather than copying it.
"""

from typing import TYPE_CHECKING

import torch

from rollout.engine.errors import (
    DuplicateRequest,
    InvalidRequest,
    KVTransferInvalid,
    KVWeightVersionMismatch,
    QueueFull,
)
from rollout.engine.multimodal import ImageInput, MultimodalPrompt, prompt_images
from rollout.engine.outputs import TokenOutput
from rollout.engine.sampling_params import SamplingParams, validate_prompt
from rollout.engine.scheduler import Batch
from rollout.kv.prefilled import PrefilledPrompt, ServedLayout

if TYPE_CHECKING:
    from rollout.engine.llm_engine import LLMEngine


def served_layout(engine: "LLMEngine") -> ServedLayout:
    """What a KV transfer must match to be imported into `engine` now."""
    m = engine.model_config
    return ServedLayout(num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
                        dtype=engine.config.torch_dtype, vocab_size=m.vocab_size, weight_version=engine.weight_version)


def prefill_for_transfer(engine: "LLMEngine", request_id: str, prompt_ids: list[int],
                         params: SamplingParams, images: list[ImageInput] = ()) -> PrefilledPrompt:
    """Prefill the prompt (with its images: one per run of image tokens) once, sample each completion's first
    token, and export the prompt's KV.

    Raises InvalidRequest like add_request, QueueFull when running requests hold the blocks it needs."""
    (result,) = prefill_many_for_transfer(engine, [(request_id, prompt_ids, params, images)])
    if isinstance(result, Exception):
        raise result
    return result


def prefill_many_for_transfer(engine: "LLMEngine", requests: list[tuple]) -> list[PrefilledPrompt | Exception]:
    """prefill_for_transfer of several (request id, prompt, params[, images]) in one prefill batch (the prefill worker's concurrent calls):
    one forward over every prompt, each request's result or its refusal (InvalidRequest, QueueFull) in order.
    Each completion samples with its own seed, so a request's tokens do not depend on its batch-mates."""
    manager = engine.block_manager
    results: list[PrefilledPrompt | Exception | None] = [None] * len(requests)
    admitted: list[tuple[int, list[int], list]] = []  # (index, prompt, sequences)
    try:
        for i, (request_id, prompt_ids, params, *images) in enumerate(requests):
            prompt = [int(t) for t in prompt_ids]
            try:
                _validate(engine, prompt, params)
                multimodal = prompt_images(engine.model_config, prompt, list(images[0]) if images else [])
                seqs = engine._new_sequences(request_id, prompt, params)
                for seq in seqs:  # before the allocation: the prefix cache keys on the images
                    seq.multimodal = multimodal
                head = seqs[0]
                while not manager.can_allocate(head) and engine.sessions.evict_idle():
                    pass
                if not manager.can_allocate(head):
                    raise QueueFull(f"running requests hold the KV blocks a prefill of {len(prompt)} tokens needs; "
                                    "retry")
            except (InvalidRequest, QueueFull, DuplicateRequest) as exc:
                results[i] = exc
                continue
            manager.allocate(head)  # a prompt prefilled before (a GRPO group's next request) reuses its cached blocks
            for child in seqs[1:]:
                manager.fork(head, child)
                child.prefill_from = head
            head.prefilling = True
            admitted.append((i, prompt, seqs))
        if admitted:
            _prefill_and_export(engine, admitted, results)
    finally:
        for _, _, seqs in admitted:
            for seq in seqs:
                manager.deallocate(seq)
    return results


def budget_batches(requests: list, budget: int) -> list[list]:
    """`requests` ((request_id, prompt, ...) tuples, in order) in batches of at most `budget` prompt tokens each
    (a longer prompt alone in its batch): how the prefill worker batches waiting calls."""
    batches: list[list] = []
    tokens = budget + 1
    for request in requests:
        if batches and tokens + len(request[1]) <= budget:
            batches[-1].append(request)
            tokens += len(request[1])
        else:
            batches.append([request])
            tokens = len(request[1])
    return batches


def _prefill_and_export(engine: "LLMEngine", admitted: list[tuple[int, list[int], list]],
                        results: list) -> None:
    """One prefill batch of the admitted requests; each one's first tokens and prompt KV into `results`."""
    everything = [seq for _, _, seqs in admitted for seq in seqs]
    batch = Batch(everything, num_new_tokens={seqs[0].seq_id: len(prompt) - seqs[0].num_cached_tokens
                                              for _, prompt, seqs in admitted},
                  sampled=everything, is_prefill=True)
    engine.step_stats.switch("step")  # the stage report's prefill (rollout/engine/step_stats.py)
    engine.step_stats.batch(batch, engine.block_manager.num_free_blocks)
    token_ids, logprobs = engine.runner.run(batch)
    engine.step_stats.switch("commands")
    offset = 0
    for i, prompt, seqs in admitted:
        head, n = seqs[0], len(seqs)
        keys, values = engine.runner.cache.export_blocks(head.block_table)
        head.num_cached_tokens = len(prompt)
        engine.block_manager.register(head)
        results[i] = PrefilledPrompt(
            prompt_ids=prompt, keys=_token_major(keys, len(prompt)), values=_token_major(values, len(prompt)),
            first_token_ids=token_ids[offset : offset + n], first_logprobs=logprobs[offset : offset + n],
            seed=head.seed, weight_version=engine.weight_version,
            mrope_positions=None if head.multimodal is None else head.multimodal.positions,
            rope_delta=0 if head.multimodal is None else head.multimodal.rope_delta)
        offset += n


def add_prefilled_request(engine: "LLMEngine", request_id: str, prefilled: PrefilledPrompt,
                          params: SamplingParams, images: list[ImageInput] = ()) -> list[TokenOutput]:
    """Queue a request whose prompt KV and first tokens come from `prefilled` (and its images, one per run of image
    tokens: the prefill's); returns the first tokens' outputs.

    `params.seed` must be the seed the first tokens were sampled with (the transfer's). Raises InvalidRequest,
    DuplicateRequest like add_request, KVTransferInvalid for a transfer that does not fit the request,
    KVWeightVersionMismatch when the engine serves other weights than the KV's, QueueFull when the blocks are
    not free now (retry)."""
    prompt = prefilled.prompt_ids
    _validate(engine, prompt, params)
    multimodal = _imported_positions(engine, prefilled, list(images))
    if params.seed != prefilled.seed or len(prefilled.first_token_ids) != params.n:
        raise KVTransferInvalid(f"the transfer's seed {prefilled.seed} and {len(prefilled.first_token_ids)} first "
                                f"tokens do not fit the request (seed {params.seed}, n={params.n})")
    if prefilled.weight_version != engine.weight_version:
        raise KVWeightVersionMismatch(f"weight_version: the KV was computed with weights version "
                                      f"{prefilled.weight_version}, this worker serves {engine.weight_version}",
                                      prefilled.weight_version, engine.weight_version)
    layout = served_layout(engine)
    expected = (layout.num_layers, len(prompt), layout.num_kv_heads, layout.head_dim)
    if tuple(prefilled.keys.shape) != expected or tuple(prefilled.values.shape) != expected:
        raise KVTransferInvalid(f"keys/values: {list(prefilled.keys.shape)}, the engine needs {list(expected)}")
    manager = engine.block_manager
    seqs = engine._new_sequences(request_id, prompt, params)
    for seq in seqs:
        seq.multimodal = multimodal
    # completion 0's blocks, and one block each for the slot of the first tokens (private copies)
    needed = manager.blocks_for(len(prompt)) + len(seqs)
    while needed > manager.num_free_blocks and engine.sessions.evict_idle():
        pass
    if needed > manager.num_free_blocks:
        raise QueueFull(f"{manager.num_free_blocks} KV blocks are free, importing this request needs {needed}; retry")
    head = seqs[0]
    manager.allocate(head, reuse_prefix=False)  # every block is written by the import, none shared
    manager.mark_uncacheable(head.block_table)
    engine.runner.cache.import_blocks(head.block_table, *(_block_major(t, len(head.block_table), manager.block_size)
                                                          for t in (prefilled.keys, prefilled.values)))
    for child in seqs[1:]:
        manager.fork(head, child)
    for seq in seqs:
        seq.num_cached_tokens = len(prompt)
        seq.context_version = prefilled.weight_version
    engine.requests[request_id] = seqs
    outputs = engine._postprocess(seqs, prefilled.first_token_ids, prefilled.first_logprobs)
    for seq in reversed(seqs):  # the children first: completion 0 then holds its last block alone
        if seq.is_finished:
            continue
        copy = manager.may_append(seq)
        if copy is not None:
            engine.runner.cache.copy_blocks([copy[0]], [copy[1]])
        engine.scheduler.add(seq)
    return outputs


def _imported_positions(engine: "LLMEngine", prefilled: PrefilledPrompt,
                        images: list[ImageInput]) -> MultimodalPrompt | None:
    """The M-RoPE state of an imported prompt: its images (kept for a recompute after preemption) at the positions
    the transfer carries. KVTransferInvalid when those are not the ones the images give the prompt (or are missing, or
    come for a text prompt); InvalidRequest when the images do not match the prompt's image tokens."""
    multimodal = prompt_images(engine.model_config, prefilled.prompt_ids, images)
    carried = prefilled.mrope_positions
    if multimodal is None and carried is None:
        return None
    if multimodal is None or carried is None:
        raise KVTransferInvalid(f"mrope_positions: the transfer carries {'none' if carried is None else 'some'} for a "
                                f"prompt with {len(images)} images")
    if (tuple(carried.shape) != tuple(multimodal.positions.shape) or not torch.equal(carried.long(), multimodal.positions)
            or prefilled.rope_delta != multimodal.rope_delta):
        raise KVTransferInvalid(f"mrope_positions: the transfer's positions (offset {prefilled.rope_delta}) are not "
                                f"those its {len(images)} images give the prompt (offset {multimodal.rope_delta})")
    return multimodal


def _validate(engine: "LLMEngine", prompt: list[int], params: SamplingParams) -> None:
    """add_request's checks of a prompt and its params against the engine's limits."""
    validate_prompt(prompt, engine.model_config.vocab_size)
    params.validate(prompt_len=len(prompt), vocab_size=engine.model_config.vocab_size,
                    max_model_len=engine.config.max_model_len, max_n=engine.config.max_n)
    manager = engine.block_manager
    if manager.blocks_for(len(prompt) + params.max_tokens) > manager.num_blocks:
        raise InvalidRequest("params.max_tokens", f"prompt + max_tokens ({len(prompt) + params.max_tokens} tokens) "
                             f"exceeds the KV cache ({manager.num_blocks} blocks of {manager.block_size})")


def _token_major(blocks: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[layers, blocks, block_size, heads, dim] -> the first num_tokens of [layers, tokens, heads, dim]."""
    layers, count, block_size, heads, dim = blocks.shape
    return blocks.reshape(layers, count * block_size, heads, dim)[:, :num_tokens].contiguous()


def _block_major(tokens: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor:
    """[layers, tokens, heads, dim] -> [layers, num_blocks, block_size, heads, dim], zero-padded."""
    layers, count, heads, dim = tokens.shape
    padded = tokens.new_zeros(layers, num_blocks * block_size, heads, dim)
    padded[:, :count] = tokens
    return padded.view(layers, num_blocks, block_size, heads, dim)
