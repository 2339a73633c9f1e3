"""Runs one scheduled batch: builds the index tensors, runs the model over the paged cache, samples."""

import torch

from rollout.attention import AttentionMetadata
from rollout.config import EngineConfig
from rollout.kv_cache import KVCache
from rollout.model import CausalLM
from rollout.sampler import Sampler, SamplingTensors, as_int64
from rollout.scheduler import Batch
from rollout.sequence import Sequence


class ModelRunner:
    def __init__(self, config: EngineConfig):
        model_config = config.model_config
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.vocab_size = model_config.vocab_size
        self.model = CausalLM(model_config, config.max_model_len, config.torch_dtype, self.device)
        with torch.no_grad():
            self.model.load_checkpoint(config.model)
        self.cache = KVCache(
            model_config.num_layers,
            config.num_blocks,
            config.block_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            config.torch_dtype,
            self.device,
        )
        self.sampler = Sampler(config.logprobs_mode)

    @torch.inference_mode()
    def run(self, batch: Batch) -> tuple[list[int], list[float]]:
        """Run the batch; returns the sampled token id and its logprob for each of batch.seqs."""
        if batch.block_copies:
            src, dst = zip(*batch.block_copies)
            self.cache.copy_blocks(list(src), list(dst))
        computed = [seq for seq in batch.seqs if seq.prefill_from is None]
        input_ids, positions, meta, last_rows = self._prepare(computed, batch.is_prefill)
        hidden = self.model(input_ids, positions, self.cache, meta)
        row_of = {id(seq): row for seq, row in zip(computed, last_rows)}
        rows = [row_of[id(seq.prefill_from or seq)] for seq in batch.seqs]
        if rows != list(range(hidden.shape[0])):
            hidden = hidden[torch.tensor(rows, device=self.device)]
        tokens, logprobs = self.sampler(self.model.logits(hidden), self._sampling_tensors(batch.seqs))
        for seq in batch.seqs:
            seq.num_cached_tokens = len(seq)
            seq.prefill_from = None
        return tokens.tolist(), logprobs.tolist()

    def _prepare(
        self, seqs: list[Sequence], is_prefill: bool
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat new tokens of the batch, their positions, attention metadata, and each seq's last row."""
        block_size, device = self.block_size, self.device
        query_lens = [len(seq) - seq.num_cached_tokens for seq in seqs]
        max_query_len = max(query_lens)
        max_blocks = max(len(seq.block_table) for seq in seqs)
        block_tables = torch.tensor(
            [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq in seqs], dtype=torch.int64
        )
        if is_prefill:
            input_ids = [t for seq in seqs for t in seq.token_ids[seq.num_cached_tokens :]]
            positions = torch.cat([torch.arange(seq.num_cached_tokens, len(seq)) for seq in seqs])
            seq_of_token = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(query_lens))
            starts = torch.tensor([seq.num_cached_tokens for seq in seqs])
            query_slots = seq_of_token * max_query_len + positions - starts[seq_of_token]
            query_positions = starts.unsqueeze(1) + torch.arange(max_query_len).unsqueeze(0)
            last_rows = torch.tensor(query_lens).cumsum(0).sub(1).tolist()
        else:
            input_ids = [seq.token_ids[-1] for seq in seqs]
            positions = torch.tensor([len(seq) - 1 for seq in seqs])
            seq_of_token = torch.arange(len(seqs))
            query_slots = None
            query_positions = positions.unsqueeze(1)
            last_rows = list(range(len(seqs)))
        slot_mapping = block_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        key_positions = torch.arange(max_blocks * block_size)
        mask = (key_positions.view(1, 1, -1) <= query_positions.unsqueeze(2)).unsqueeze(1)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(device),
            block_tables=block_tables.to(device),
            mask=mask.to(device),
            query_slots=None if query_slots is None else query_slots.to(device),
            max_query_len=max_query_len,
        )
        return torch.tensor(input_ids, device=device), positions.to(device), meta, last_rows

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        device = self.device
        temperatures = [seq.params.temperature for seq in seqs]
        top_ps = [seq.params.top_p for seq in seqs]
        top_ks = [seq.params.top_k if seq.params.top_k > 0 else self.vocab_size for seq in seqs]
        return SamplingTensors(
            temperatures=torch.tensor(temperatures, dtype=torch.float32, device=device),
            top_ps=torch.tensor(top_ps, dtype=torch.float32, device=device),
            top_ks=torch.tensor(top_ks, dtype=torch.int64, device=device),
            seeds=torch.tensor([as_int64(seq.seed) for seq in seqs], dtype=torch.int64, device=device),
            indices=torch.tensor([seq.index for seq in seqs], dtype=torch.int64, device=device),
            positions=torch.tensor([len(seq) for seq in seqs], dtype=torch.int64, device=device),
            any_sampled=any(t > 0 for t in temperatures),
            any_filtered=any(t > 0 and (p < 1 or k < self.vocab_size) for t, p, k in zip(temperatures, top_ps, top_ks)),
        )

