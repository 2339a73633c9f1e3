"""Runs one scheduled batch: builds the index tensors, runs the model over the paged cache, samples."""

import itertools
from collections.abc import Collection

import torch

from rollout.config import EngineConfig
from rollout.engine.cuda_graphs import DecodeGraphs
from rollout.engine.routes import host_routes, record
from rollout.engine.sampler import Sampler, SamplingTensors, completion_key, row_keys
from rollout.engine.scheduler import Batch
from rollout.engine.sequence import Sequence
from rollout.kv.cache import KVCache, to_device
from rollout.kv.quantized import QuantizedKVCache, block_codec
from rollout.model.attention import (
    AttentionGroup,
    AttentionMetadata,
    FixedShapeAttention,
    LengthClass,
    Observation,
    PagedKernel,
)
from rollout.model.attention_flashinfer import FlashInferAttention
from rollout.model.lora import ResidentAdapters
from rollout.model.moe import set_moe_kernel
from rollout.model.registry import model_class
from services.device import device_scope


class ModelRunner:
    def __init__(self, config: EngineConfig):
        model_config = config.model_config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.vocab_size = model_config.vocab_size
        self.model = model_class(model_config.model_type)(model_config, config.max_model_len, config.torch_dtype,
                                                          self.device, config.lm_head_fp32)
        with torch.no_grad():
            self.model.load_checkpoint(config.model)
        set_moe_kernel(self.model, config.moe_kernel)
        # LoRA served unmerged: the adapter versions resident, applied per row (rollout/model/lora.py)
        self.adapters = (ResidentAdapters(self.model, config.lora.versions_resident)
                         if config.lora.mode == "unmerged" else None)
        # In the model dtype, or quantized (kv_cache_dtype); with CUDA graphs one more block: the padding rows' scratch
        self.cache = make_kv_cache(config, self.device)
        self.attention_kernel = config.attention_kernel  # "torch", "triton" or "flashinfer" (rollout/model/attention.py)
        self.scale = model_config.head_dim**-0.5  # the model's attention scale (rollout/model/decoder.py)
        self.kernel = None  # FlashInfer's wrapper, planned each step
        if config.attention_kernel == "flashinfer":
            self.kernel = FlashInferAttention(model_config.num_heads, model_config.num_kv_heads, model_config.head_dim,
                                              config.block_size, config.torch_dtype, self.device)
        self.sampler = Sampler(config.logprobs_mode)
        # Built once, read every step: key positions of the widest block table and the two mask values.
        max_blocks = -(-config.max_model_len // config.block_size)
        self.graphs = None  # decode steps on static buffers, replayed from CUDA graphs (rollout/engine/cuda_graphs.py)
        if config.cuda_graphs:
            self.graphs = DecodeGraphs(self.model, self.cache, self._fixed_shape_attention, config.max_num_seqs,
                                       max_blocks, config.num_blocks, self.device)
            if self.graphs.capture:
                self.graphs.capture_all()
        self._key_positions = torch.arange(max_blocks * config.block_size, device=self.device)
        self.length_classes = config.attention_length_classes
        self.observation_window = config.kv_observation_window
        self.observations: dict[int, list[torch.Tensor]] = {}  # of the last run: see attention.Observation
        self._attend = torch.tensor(0.0, dtype=config.torch_dtype, device=self.device)
        self._ignore = torch.tensor(float("-inf"), dtype=config.torch_dtype, device=self.device)

    @torch.inference_mode()
    def run(self, batch: Batch) -> tuple[list[int], list[float]]:
        """Run the batch; returns the sampled token id and its logprob for each of batch.sampled. On the engine's
        device whatever thread calls (services.device.device_scope); the host waits for the device once, for the
        sampled tokens: every tensor made from host values comes through kv.cache.to_device."""
        with device_scope(self.device):
            return self._run(batch)

    def _run(self, batch: Batch) -> tuple[list[int], list[float]]:
        if batch.block_copies:
            src, dst = zip(*batch.block_copies)
            self.cache.copy_blocks(list(src), list(dst))
        computed = [seq for seq in batch.seqs if seq.prefill_from is None]
        if batch.is_prefill:  # one-token rows first: they attend as a group of their own (see _prepare)
            computed.sort(key=lambda seq: batch.num_new_tokens[seq.seq_id] > 1)
        query_lens = [batch.num_new_tokens[seq.seq_id] for seq in computed]
        adapting = self._select_adapters(computed, query_lens)
        if self.graphs is not None and not batch.is_prefill and not batch.observe and not adapting:
            hidden = self.graphs.run(self._decode_rows(computed))
            last_rows = list(range(len(computed)))
            self.observations = {}
        else:  # (a LoRA step runs eager: the graphs hold no adapters)
            input_ids, positions, meta, last_rows = self._prepare(computed, batch.is_prefill, query_lens, batch.observe)
            positions, embeds = self._mrope_inputs(computed, batch.is_prefill, query_lens, positions)
            hidden = self.model(input_ids, positions, self.cache, meta, embeds)
            self.observations = meta.observations
            self._record_routes(batch, computed)
        if not batch.sampled:  # every sequence is mid-prefill
            return [], []
        row_of = {id(seq): row for seq, row in zip(computed, last_rows)}
        rows = [row_of[id(seq.prefill_from or seq)] for seq in batch.sampled]
        if rows != list(range(hidden.shape[0])):
            hidden = hidden[self._tensor(rows)]
        tokens, logprobs = self.sampler(self.model.logits(hidden), self._sampling_tensors(batch.sampled))
        both = torch.cat([tokens.double(), logprobs.double()]).tolist()  # one read (token ids < 2**53 are exact)
        return [int(token) for token in both[: len(rows)]], both[len(rows) :]

    def _select_adapters(self, seqs: list[Sequence], row_counts: list[int]) -> bool:
        """Tell the resident adapters which rows of the next forward use which version (each sequence's pinned
        `policy_version`); whether any adapter applies."""
        if self.adapters is None or not self.adapters.active:
            return False
        self.adapters.select([seq.policy_version for seq, count in zip(seqs, row_counts) for _ in range(count)],
                             self.device)
        return bool(self.adapters.plan)

    def _record_routes(self, batch: Batch, computed: list[Sequence]) -> None:
        """A mixture-of-experts model's routes of this step's tokens, kept on their sequences (rollout/engine/routes.py);
        a fork that samples from its sibling's prefill takes the sibling's."""
        experts = self.model.routed_experts()
        if experts is None:
            return
        rows = host_routes(experts, self.model.config.moe.num_experts)
        record(computed, [seq.num_cached_tokens for seq in computed],
               [batch.num_new_tokens[seq.seq_id] for seq in computed], rows)
        for seq in batch.seqs:
            if seq.prefill_from is not None and seq.prefill_from.routes is not None:
                seq.routes = seq.prefill_from.routes.copy()

    def score(self, seqs: list[Sequence], starts: list[int], temperature: float = 1.0,
              top: int = 0) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
        with device_scope(self.device):
            return self._score(seqs, starts, temperature, top)

    @torch.inference_mode()
    def _score(self, seqs: list[Sequence], starts: list[int], temperature: float,
               top: int) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
        """Logprobs under softmax(logits / temperature) of tokens starts[i]: of each sequence given the tokens before them,
        and at each of those positions the `top` most likely tokens with theirs ([] when top is 0).

        One prefill over the whole sequences (fresh: blocks for every token, none cached yet); logits are made per
        sequence, so a long sequence with a large vocabulary never holds [all tokens, vocab] at once.
        """
        input_ids, positions, meta, last_rows = self._prepare(seqs, is_prefill=True)
        self._select_adapters(seqs, [len(seq) for seq in seqs])
        positions, embeds = self._mrope_inputs(seqs, True, None, positions)
        hidden = self.model(input_ids, positions, self.cache, meta, embeds)
        results = []
        for seq, start, last in zip(seqs, starts, last_rows):
            first = last - len(seq) + 1  # the sequence's first row
            targets = input_ids[first + start : last + 1]
            logits = self.model.logits(hidden[first + start - 1 : last]).float()
            if temperature != 1.0:
                logits = logits / temperature
            log_norm = torch.logsumexp(logits, dim=-1)
            chosen = (logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_norm).tolist()
            tops: list[list[tuple[int, float]]] = []
            if top:
                values, ids = logits.topk(min(top, logits.shape[-1]), dim=-1)
                values = values - log_norm.unsqueeze(-1)
                tops = [list(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
            results.append((chosen, tops))
        return results

    def _prepare(
        self, seqs: list[Sequence], is_prefill: bool, query_lens: list[int] | None = None,
        observe: Collection[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat new tokens of the batch, their positions, attention metadata, and each seq's last row.

        In a prefill, each sequence computes `query_lens` tokens from its num_cached_tokens (None: all the rest).
        A token at position p is written to cache slot p - num_evicted_tokens and sees the slots before it. The
        sequences whose seq_id is in `observe` also report what their latest queries attend to (kv_eviction.py).

        Leading sequences with one new token (a decode, also one mixed into a prefill step: `run` puts them
        first) attend as one group, the rest as another, each padded only to its own longest query."""
        block_size = self.block_size
        if is_prefill:
            starts = [seq.num_cached_tokens for seq in seqs]
            if query_lens is None:
                query_lens = [len(seq) - start for seq, start in zip(seqs, starts)]
            input_ids = [t for seq, start, n in zip(seqs, starts, query_lens) for t in seq.token_ids[start : start + n]]
            positions = [p for start, n in zip(starts, query_lens) for p in range(start, start + n)]
            owners = [seq for seq, n in zip(seqs, query_lens) for _ in range(n)]
            last_rows = list(itertools.accumulate(query_lens, initial=-1))[1:]
            split = next((i for i, n in enumerate(query_lens) if n > 1), len(seqs))
        else:
            input_ids = [seq.token_ids[-1] for seq in seqs]
            positions = starts = [len(seq) - 1 for seq in seqs]
            query_lens = None
            owners = seqs
            last_rows = list(range(len(seqs)))
            split = len(seqs)
        slots = positions
        shifts = [seq.num_evicted_tokens for seq in seqs]
        if any(shifts):
            slots = [p - seq.num_evicted_tokens for seq, p in zip(owners, positions)]
            starts = [start - shift for start, shift in zip(starts, shifts)]
        slot_mapping = [seq.block_table[s // block_size] * block_size + s % block_size for seq, s in zip(owners, slots)]
        # One host-to-tensor copy for the three per-token lists (each torch.tensor call costs several ops).
        input_ids_t, positions_t, slot_mapping_t = self._tensor([*input_ids, *positions, *slot_mapping]).view(3, -1)
        self.cache.plan_write(slot_mapping, slot_mapping_t)  # a quantized cache plans its write on the host
        if self.attention_kernel != "torch" and not observe:  # a kernel reads the block tables; no classes to build
            row_lens = query_lens if query_lens is not None else [1] * len(seqs)
            kernel = self._plan_kernel(seqs, row_lens, [start + n for start, n in zip(starts, row_lens)])
            return input_ids_t, positions_t, AttentionMetadata(slot_mapping_t, [], kernel=kernel), last_rows
        groups = []
        if split:  # one new token each: rows 0..split-1, at their slots
            decode_slots = self._tensor(starts[:split]) if any(shifts) else positions_t[:split]
            groups.append(self._group(seqs[:split], slice(0, split), decode_slots.unsqueeze(1), None, 1,
                                      [start + 1 for start in starts[:split]], observe))
        if split < len(seqs):
            lens = query_lens[split:]
            longest = max(lens)
            offsets = torch.arange(longest, device=self.device)
            query_positions = self._tensor(starts[split:]).unsqueeze(1) + offsets
            query_slots = self._tensor([i * longest + j for i, n in enumerate(lens) for j in range(n)])
            groups.append(self._group(seqs[split:], slice(split, len(input_ids)), query_positions, query_slots, longest,
                                      [s + n for s, n in zip(starts[split:], lens)], observe, lens))
        return input_ids_t, positions_t, AttentionMetadata(slot_mapping=slot_mapping_t, groups=groups), last_rows

    def _mrope_inputs(self, seqs: list[Sequence], is_prefill: bool, query_lens: list[int] | None,
                      positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """A model with 3-D positions (a vision-language model, rollout/engine/multimodal.py): the [3, T] positions of
        the rows `_prepare` built, and (rows, embeddings) of the image tokens among them, the vision tower run on a
        request's images at the first chunk that needs them (kept until its prefill has passed its last image token).
        Other models: `positions` as they are, no embeddings."""
        if not self.model.mrope:
            return positions, None
        if not is_prefill:  # one text token each, its three positions equal: index + the request's offset
            return self._tensor([len(seq) - 1 + (seq.multimodal.rope_delta if seq.multimodal else 0) for seq in seqs]), None
        starts = [seq.num_cached_tokens for seq in seqs]
        counts = query_lens or [len(seq) - start for seq, start in zip(seqs, starts)]
        hits = [None if seq.multimodal is None else
                (seq.multimodal.image_rows >= start) & (seq.multimodal.image_rows < start + count)
                for seq, start, count in zip(seqs, starts, counts)]
        needed = {id(seq.multimodal): seq.multimodal for seq, hit in zip(seqs, hits)  # one each: scoring shares them
                  if hit is not None and seq.multimodal.embeds is None and bool(hit.any())}
        self._encode(list(needed.values()))
        columns, rows, values, offset, passed = [], [], [], 0, []
        for seq, start, count, hit in zip(seqs, starts, counts, hits):
            prompt = seq.multimodal
            if prompt is None:
                columns.append(torch.arange(start, start + count).expand(3, -1))
            else:
                columns.append(prompt.rope_positions(start, count))
                if bool(hit.any()):
                    rows.append(prompt.image_rows[hit] - start + offset)
                    values.append(prompt.embeds[hit.to(self.device)])
                    if start + count > int(prompt.image_rows[-1]):
                        passed.append(prompt)
            offset += count
        for prompt in passed:  # its prefill has passed its last image token
            prompt.embeds = None
        positions = torch.cat(columns, dim=1).to(self.device)
        return positions, ((torch.cat(rows).to(self.device), torch.cat(values)) if rows else None)

    def _encode(self, prompts: list) -> None:
        """The vision tower over the images of `prompts` (MultimodalPrompt) in one call; each gets its embeddings."""
        if not prompts:
            return
        images = [image for prompt in prompts for image in prompt.images]
        pixels = torch.cat([image.pixel_values for image in images]).to(self.device)
        embeds = self.model.encode_images(pixels, self._tensor([list(image.grid_thw) for image in images]))
        for prompt, part in zip(prompts, embeds.split([len(prompt.image_rows) for prompt in prompts])):
            prompt.embeds = part

    def _plan_kernel(self, seqs: list[Sequence], query_lens: list[int], kv_lens: list[int]) -> PagedKernel:
        tables = [seq.block_table for seq in seqs]
        if self.attention_kernel == "flashinfer":
            self.kernel.plan(tables, query_lens, kv_lens)
            return self.kernel
        from rollout.model.attention_triton import TritonAttention  # imports triton: only where it was chosen

        return TritonAttention.plan(tables, query_lens, kv_lens, self.block_size, self.scale, self.device)

    def _decode_rows(self, seqs: list[Sequence]) -> list[list[int]]:
        """A decode step's rows for DecodeGraphs.run: token, position, slot, context length, block table."""
        rows = []
        for seq in seqs:
            position = len(seq) - 1
            slot = position - seq.num_evicted_tokens
            if seq.multimodal is not None:  # a decoded token's three M-RoPE positions are equal: one suffices
                position += seq.multimodal.rope_delta
            block_slot = seq.block_table[slot // self.block_size] * self.block_size + slot % self.block_size
            rows.append([seq.token_ids[-1], position, block_slot, slot + 1, *seq.block_table])
        return rows

    def _fixed_shape_attention(self, block_tables: torch.Tensor, context_lens: torch.Tensor,
                               query_starts: torch.Tensor) -> PagedKernel:
        """The attention of a CUDA-graph bucket (one query per row): the Triton kernel, or on CPU with the torch
        backend attention.FixedShapeAttention."""
        if self.attention_kernel == "triton":
            from rollout.model.attention_triton import TritonAttention

            return TritonAttention(block_tables, query_starts, context_lens, 1, self.scale)
        return FixedShapeAttention(block_tables, context_lens, self.scale)

    def _group(self, seqs: list[Sequence], rows: slice, query_positions: torch.Tensor, query_slots: torch.Tensor | None,
               max_query_len: int, kv_lens: list[int], observe: Collection[int] = (),
               query_lens: list[int] | None = None) -> AttentionGroup:
        """The attention of `seqs`, whose queries sit at cache slots `query_positions` ([B, max_query_len]) and see
        the first kv_lens[i] slots of their sequence, split into length classes by blocks needed
        (rollout/model/attention.py). Sequences in `observe` report the attention of their last `observation_window`
        queries (of `query_lens[i]`, one each when None)."""
        block_size = self.block_size
        needed = [-(-n // block_size) for n in kv_lens]
        members: dict[int, list[int]] = {}
        for i, n in enumerate(needed):
            members.setdefault((n - 1).bit_length() if self.length_classes else 0, []).append(i)
        classes = []
        for indices in members.values():
            width = max(needed[i] for i in indices)
            block_ids = []
            for i in indices:
                table = seqs[i].block_table[:width]
                block_ids += table + [0] * (width - len(table))
            everyone = len(indices) == len(seqs)
            rows_t = None if everyone else self._tensor(indices)
            positions = query_positions if everyone else query_positions[rows_t]
            visible = self._key_positions[: width * block_size] <= positions.unsqueeze(-1)
            watched = [(row, i) for row, i in enumerate(indices) if seqs[i].seq_id in observe] if observe else []
            classes.append(LengthClass(rows=rows_t, block_ids=self._tensor(block_ids), num_blocks=width,
                                       mask=torch.where(visible, self._attend, self._ignore).unsqueeze(1),
                                       observed=self._observed(seqs, watched, max_query_len, query_lens)))
        return AttentionGroup(rows=rows, num_seqs=len(seqs), classes=classes, query_slots=query_slots,
                              max_query_len=max_query_len)

    def _observed(self, seqs: list[Sequence], watched: list[tuple[int, int]], max_query_len: int,
                  query_lens: list[int] | None) -> Observation | None:
        """Which rows of a length class report their attention, and the weights of their last queries."""
        if not watched:
            return None
        weights = torch.zeros(len(watched), max_query_len, dtype=torch.float32, device=self.device)
        for k, (_, i) in enumerate(watched):
            n = 1 if query_lens is None else query_lens[i]
            last = min(n, self.observation_window)
            weights[k, n - last : n] = 1.0 / last
        return Observation(rows=self._tensor([row for row, _ in watched]), seq_ids=[seqs[i].seq_id for _, i in watched],
                           query_weights=weights)

    def _tensor(self, values: list) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """The batch's sampling controls in two host-to-device copies (float32 and int64)."""
        n = len(seqs)
        temperatures = [seq.params.temperature for seq in seqs]
        top_ps = [seq.params.top_p for seq in seqs]
        top_ks = [seq.params.top_k if seq.params.top_k > 0 else self.vocab_size for seq in seqs]
        floats = to_device(temperatures + top_ps, torch.float32, self.device)
        keys = [completion_key(seq.seed, seq.index) for seq in seqs]
        ints = to_device(top_ks + row_keys(keys, [len(seq) for seq in seqs]), torch.int64, self.device)
        return SamplingTensors(
            temperatures=floats[:n],
            top_ps=floats[n:],
            top_ks=ints[:n],
            row_keys=ints[n:],
            any_sampled=any(t > 0 for t in temperatures),
            any_filtered=any(t > 0 and (p < 1 or k < self.vocab_size) for t, p, k in zip(temperatures, top_ps, top_ks)),
        )


def make_kv_cache(config: EngineConfig, device: torch.device) -> KVCache | QuantizedKVCache:
    """The cache `config.kv_cache_dtype` names: KVCache in the model dtype ("auto") or a QuantizedKVCache. With
    config.cuda_graphs a KVCache holds one block more than the block manager hands out: the padding rows' scratch."""
    m = config.model_config
    shape = (m.num_layers, config.num_blocks, config.block_size, m.num_kv_heads, m.head_dim)
    if config.kv_cache_dtype == "auto":
        scratch = 1 if config.cuda_graphs else 0  # block num_blocks: never handed out (rollout/engine/cuda_graphs.py)
        return KVCache(shape[0], config.num_blocks + scratch, *shape[2:], config.torch_dtype, device)
    return QuantizedKVCache(*shape, config.torch_dtype, device, block_codec(config.kv_cache_dtype, config.block_size),
                            config.kv_open_blocks)
