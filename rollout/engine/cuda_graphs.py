"""Decode steps on static buffers, replayed from CUDA graphs: one graph per batch-size bucket (nano-vllm's way).

A decode step of B sequences runs as the smallest bucket >= B (1, 2, 4, 8, 16, then multiples of 16 up to
max_num_seqs). Its inputs go into buffers that never move: one int64 tensor with a row per sequence (token,
position, cache slot, context length, block table), filled by one host-to-device copy per step. Rows past B are
padding: token 0 at position 0, written to a scratch slot (a cache block the block manager never hands out) and
attending to that slot alone, so they touch no sequence's KV and stay finite. The model's hidden states land in a
static output buffer; the logits and the sampler run eagerly on its first B rows.

On CUDA each bucket's forward pass is captured once (after a warm-up call on a side stream that compiles the Triton
kernel) into a torch.cuda.CUDAGraph sharing one memory pool, largest bucket first, and every later decode step of that
bucket is a replay: no kernel launches from Python, no host syncs. Captures run on the engine's device whatever thread
calls them (services.device.device_scope: a thread starts on cuda:0), in capture_error_mode "thread_local", so the
weight receiver's thread allocating or synchronizing meanwhile cannot invalidate one. That is valid because nothing in the pass depends on host
values that change: the attention is the Triton kernel over the buffers' fixed-shape block tables, its grid fixed by
the bucket (rollout/model/attention_triton.py). On CPU a "replay" is a plain call of the model on the same buffers
(attention: attention.FixedShapeAttention), so the buckets, the padding and the buffers are tested without a GPU.

Graphs hold the addresses of the weights: a weight update copies the new tensors into the captured parameters in place
(LLMEngine.load_weights), so the graphs stay valid across updates and are captured once per engine. Prefill and
chunked steps, and steps that report attention scores, stay eager.
"""

import time
from collections.abc import Callable

import torch

from rollout.kv.cache import KVCache, to_device
from rollout.model.attention import AttentionMetadata, PagedKernel
from rollout.model.decoder import CausalLM
from services.device import device_scope

TOKEN, POSITION, SLOT, CONTEXT, TABLE = 0, 1, 2, 3, 4  # the columns of a row of the static inputs


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, 16, 32, 48, ... and max_num_seqs itself."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += range(16, max_num_seqs, 16)
    return [*sizes, max_num_seqs]


# (block_tables [B, W], context_lens [B], query_starts [B + 1]) -> the attention a bucket's forward pass runs
AttentionFactory = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], PagedKernel]


class DecodeGraphs:
    def __init__(self, model: CausalLM, cache: KVCache, attention: AttentionFactory, max_num_seqs: int,
                 max_blocks_per_seq: int, scratch_block: int, device: torch.device):
        self.model = model
        self.cache = cache
        self.buckets = batch_buckets(max_num_seqs)
        self.device = device
        self.capture = device.type == "cuda"
        self.pad_row = [0, 0, scratch_block * cache.block_size, 1, scratch_block]
        self.inputs = torch.tensor([self.pad_row + [0] * (max_blocks_per_seq - 1)] * max_num_seqs, dtype=torch.int64,
                                   device=device)
        hidden = model.config.hidden_size
        self.outputs = torch.zeros(max_num_seqs, hidden, dtype=model.model.embed_tokens.weight.dtype, device=device)
        query_starts = torch.arange(max_num_seqs + 1, dtype=torch.int32, device=device)
        self.metadata = {bucket: AttentionMetadata(
            slot_mapping=self.inputs[:bucket, SLOT], groups=[],
            kernel=attention(self.inputs[:bucket, TABLE:], self.inputs[:bucket, CONTEXT], query_starts[: bucket + 1]),
        ) for bucket in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_stats: dict[int, tuple[float, int]] = {}  # bucket -> (seconds, bytes the pool grew) of its capture
        self.pool = None
        self.num_replays = 0  # decode steps run from the static buffers (replays on CUDA, plain calls on CPU)
        self.last_bucket = 0

    def bucket_for(self, num_seqs: int) -> int:
        return next(bucket for bucket in self.buckets if bucket >= num_seqs)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket's graph (CUDA), largest first so that the smaller ones fit in its memory pool; the
        buffers hold padding rows only, so the captures' warm-up passes write nothing but the scratch slot."""
        for bucket in reversed(self.buckets):
            self._graph(bucket)

    def run(self, rows: list[list[int]]) -> torch.Tensor:
        """Hidden states [len(rows), hidden] of one decode step; rows[i] = [token, position, slot, context length,
        *block table] of sequence i (its new token's KV written at the slot, attending to the first context length
        slots of its blocks)."""
        bucket = self.bucket_for(len(rows))
        width = max(len(row) for row in rows)
        padded = [row + [0] * (width - len(row)) for row in rows]
        padded += [self.pad_row + [0] * (width - len(self.pad_row))] * (bucket - len(rows))
        self.inputs[:bucket, :width].copy_(to_device(padded, torch.int64, self.device))
        if self.capture:
            self._graph(bucket).replay()
        else:
            self._forward(bucket)
        self.num_replays += 1
        self.last_bucket = bucket
        return self.outputs[: len(rows)]

    def _forward(self, bucket: int) -> None:
        inputs = self.inputs[:bucket]
        self.outputs[:bucket] = self.model(inputs[:, TOKEN], inputs[:, POSITION], self.cache, self.metadata[bucket])

    def _graph(self, bucket: int) -> "torch.cuda.CUDAGraph":
        graph = self.graphs.get(bucket)
        if graph is None:
            with device_scope(self.device):
                started, reserved = time.perf_counter(), torch.cuda.memory_reserved(self.device)
                graph = self._capture(bucket)
                torch.cuda.synchronize(self.device)
                grown = torch.cuda.memory_reserved(self.device) - reserved
            self.graphs[bucket] = graph
            self.capture_stats[bucket] = (time.perf_counter() - started, grown)
        return graph

    def _capture(self, bucket: int) -> "torch.cuda.CUDAGraph":
        # Warm-up on a side stream (compiles the kernels, settles the allocator) outside the capture.
        stream, side = torch.cuda.current_stream(self.device), torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            self._forward(bucket)
        stream.wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._forward(bucket)
        self.pool = graph.pool()
        return graph
