"""LLMEngine: requests in, tokens (with logprob and weight version) out, one step at a time.

Not thread-safe: one thread calls add_request / abort / step / load_weights (AsyncEngine's loop).
"""

import itertools
import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch

from rollout.config import EngineConfig
from rollout.engine.adapter_pins import repin, split_update
from rollout.engine.block_manager import BlockManager
from rollout.engine.errors import ContextFull, DuplicateRequest, InvalidRequest, QueueFull
from rollout.engine.kv_eviction import KVEvictor
from rollout.engine.model_info import Layout, ModelInfo
from rollout.engine.model_runner import ModelRunner
from rollout.engine.multimodal import ImageInput, prompt_images
from rollout.engine.outputs import Completion, RequestOutput, TokenOutput
from rollout.engine.sampling_params import SamplingParams, logprobs_temperature, validate_prompt
from rollout.engine.scheduler import Batch, Scheduler
from rollout.engine.scoring import Scoring
from rollout.engine.sequence import FinishReason, Sequence
from rollout.engine.session_steps import SessionSteps
from rollout.engine.sessions import SessionTable
from rollout.engine.step_stats import EngineStepStats, engine_flop_model
from rollout.kv.host_tier import TIER_STATS, HostKVTier
from services.device import device_scope, synchronize


class LLMEngine(SessionSteps, Scoring):
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_config = config.model_config
        self.runner = ModelRunner(config)
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.sessions = SessionTable(self.block_manager, config.max_model_len, config.max_sessions,
                                     config.session_idle_timeout_s, tier=host_tier(config, self.runner.cache),
                                     policy=config.session_policy, pin_ttl_s=config.session_pin_ttl_s,
                                     admission=config.session_admission,
                                     admission_wait_s=config.session_admission_wait_s)
        self.scheduler = Scheduler(config, self.block_manager, reclaim=self.sessions.evict_idle,
                                   restore=self.sessions.restore)
        self.evictor = (KVEvictor(config, self.block_manager, self.runner.cache)
                        if config.kv_eviction != "none" else None)
        self.requests: dict[str, list[Sequence]] = {}
        self.weight_version = 0
        self.num_version_moves = 0  # started sequences a weight update moved off their version (adapter_pins.py)
        # the stage report's tallies (rollout/engine/step_stats.py); its FLOPs by the trainer's model (services/flops.py)
        self.step_stats = EngineStepStats(engine_flop_model(self.runner.model, self.model_config),
                                          self.block_manager.num_blocks)
        self._next_expiry_check = 0.0
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

    @property
    def info(self) -> ModelInfo:
        config = self.config
        return ModelInfo("native", self.model_config.vocab_size, config.max_model_len, self.model_config.eos_token_ids,
                         config.logprobs_mode, config.session_idle_timeout_s)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live, with the CUDA index ("cuda" resolved when they were made)."""
        return next(self.runner.model.parameters()).device

    @property
    def adopts_weights(self) -> bool:
        """Whether load_weights(adopt=True) serves the given tensors themselves; not with static decode buffers
        (CUDA graphs hold the parameters' addresses: the tensors are copied in place, and free afterwards)."""
        return self.runner.graphs is None

    @property
    def serves_adapters_unmerged(self) -> bool:
        """Whether LoRA adapters in an update become resident versions (config.lora.mode unmerged)."""
        return self.runner.adapters is not None

    def adapter_problem(self, weight: str) -> str | None:
        """Why an adapter of parameter `weight` (published name) cannot be served unmerged; None when it can."""
        return self.runner.adapters.problem(weight)

    def parameter_layout(self) -> Layout:
        """name -> (shape, dtype) of every parameter a weight update may carry, under the names a trainer's state
        dict has (CausalLM.published_name)."""
        model = self.runner.model
        return {model.published_name(name): (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams,
                    images: Seq[ImageInput] = ()) -> None:
        """Queue a request; raises InvalidRequest, DuplicateRequest or QueueFull. `images`: one per run of image
        tokens in the prompt, in order (a vision-language model; rollout/engine/multimodal.py)."""
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
        multimodal = prompt_images(self.model_config, prompt, list(images))
        seqs = self._new_sequences(request_id, prompt, params)
        for seq in seqs:
            seq.multimodal = multimodal
        seqs[0].forks = seqs[1:]
        self.scheduler.add(seqs[0])
        self.requests[request_id] = seqs

    def _new_sequences(self, request_id: str, prompt: list[int], params: SamplingParams) -> list[Sequence]:
        if request_id in self.requests:
            raise DuplicateRequest(f"request_id: {request_id!r} is already running")
        if len(self.scheduler.waiting) >= self.config.max_queue:
            raise QueueFull(f"{len(self.scheduler.waiting)} requests are waiting (max_queue={self.config.max_queue})")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(64)
        seqs = [Sequence(next(self._seq_ids), request_id, i, prompt, params, seed) for i in range(params.n)]
        for seq in seqs:
            seq.policy_version = self.weight_version
        return seqs

    # ---- sessions (rollout/engine/sessions.py)

    def open_session(self, session_id: str, prompt_ids: Seq[int], images: Seq[ImageInput] = ()) -> int:
        """SessionSteps.open_session, with the initial context's images (one per run of image tokens)."""
        multimodal = prompt_images(self.model_config, [int(t) for t in prompt_ids], list(images))
        length = super().open_session(session_id, prompt_ids)
        self.sessions.sessions[session_id].multimodal = multimodal
        return length

    def append_to_session(self, session_id: str, token_ids: Seq[int], turn_reward: float | None = None,
                          images: Seq[ImageInput] = ()) -> int:
        """SessionSteps.append_to_session, with the observation's images: their positions continue the context's."""
        session = self.sessions.idle(session_id)
        start = len(session.token_ids)
        multimodal = prompt_images(self.model_config, session.token_ids + [int(t) for t in token_ids], list(images),
                                   session.multimodal, start)
        length = super().append_to_session(session_id, token_ids, turn_reward)
        session.multimodal = multimodal
        return length

    def add_session_request(self, request_id: str, session_id: str, params: SamplingParams,
                            expected_idle_s: float | None = None) -> None:
        """Queue the session's next policy turn (one completion, max_tokens cut to the context left); KV of it that
        went to the host tier comes back when the turn starts (Scheduler.restore). `expected_idle_s`: how long the caller's tool will take after
        this turn (engine.session_policy kv_aware schedules by it)."""
        session, params = self._turn(session_id, params)
        context = len(session.token_ids)
        if self.block_manager.blocks_for(context + params.max_tokens) > self.block_manager.num_blocks:
            raise ContextFull(f"the session's context + max_tokens ({context + params.max_tokens} tokens) exceeds "
                              f"the KV cache ({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})")
        [seq] = self._new_sequences(request_id, session.token_ids, params)
        session.next_idle_s = expected_idle_s
        seq.multimodal = session.multimodal
        self.sessions.start_turn(session, seq, logprobs_temperature(self.config.logprobs_mode, params.temperature))
        self.scheduler.add(seq)
        self.requests[request_id] = [seq]

    def step(self) -> list[TokenOutput]:
        """Schedule, run, post-process: one step of decodes and prefill chunks. Returns one output per sequence
        that sampled (a sequence whose prefill is not complete yet samples nothing)."""
        self.step_stats.switch("step")  # its time goes to prefill and decode by their tokens
        batch = self.scheduler.schedule()
        if batch is None:
            self.step_stats.switch("commands")
            return []
        due = self.evictor.plan(batch) if self.evictor is not None else []
        self.step_stats.batch(batch, self.block_manager.num_free_blocks)
        self._stamp_kv_versions(batch)
        token_ids, logprobs = self.runner.run(batch)
        self.scheduler.update(batch)
        outputs = self._postprocess(batch.sampled, token_ids, logprobs)
        if due:
            self.evictor.evict(due, self.runner.observations)
        self.step_stats.sampled(batch.sampled)
        return outputs

    def _stamp_kv_versions(self, batch: Batch) -> None:
        """A sequence that computes its first KV (a new prompt, a recompute) computes it with the weights served now;
        a fork shares its sibling's."""
        for seq in batch.seqs:
            if seq.context_version is None:
                source = seq.prefill_from
                seq.context_version = seq.policy_version if source is None else source.context_version

    def abort(self, request_id: str) -> list[TokenOutput]:
        """End a request's unfinished completions (reason abort, partial output kept) and free their blocks."""
        outputs = []
        for seq in self.requests.pop(request_id, []):
            if not seq.is_finished:
                seq.finish_reason = FinishReason.ABORT
                self._finish(seq)
                outputs.append(TokenOutput(request_id, seq.index, None, None, None, FinishReason.ABORT, seq.kv_version,
                                           seq.routed_experts))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def load_weights(
        self, named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int,
        adopt: bool = False,
    ) -> None:
        """Serve `version`: the tensors copied into the parameters of the same name, in place, or with `adopt` served
        themselves (a complete update whose memory the caller hands over, CausalLM.adopt_weights) unless decode steps
        run from static buffers (config.cuda_graphs: copied in place, the graphs stay valid; the tensors are free once
        this returns). LoRA adapters among them (`<module>.lora_A.weight`, `.lora_B.weight`), with lora.mode
        unmerged, become a resident adapter version instead (rollout/model/lora.py; copied): an update of adapters
        alone leaves W as it is, one with the model's tensors replaces W and forgets older adapters.

        Sequences in flight continue, on their version or moved to the new one (rollout/engine/adapter_pins.py).
        KV computed with older weights (config.kv_on_update): "keep" keeps it (kv_version says so), "recompute"
        drops it and each sequence recomputes its context before its next token (the scheduler's preemption), each
        session at its next turn. The prefix cache forgets every prefix, except after an adapter-only update served
        unmerged: its keys carry the version, and older versions' prefixes stay valid for their pinned sequences.
        """
        base, adapters = split_update(named_tensors)
        lora = self.runner.adapters
        if adapters and lora is None:
            raise ValueError("this engine serves LoRA merged (lora.mode: merged): merge the adapters before loading")
        with torch.no_grad(), device_scope(self.runner.device):
            if base and adopt and self.runner.graphs is None:
                self.runner.model.adopt_weights(base)
            elif base:
                self.runner.model.load_weights(base)
                synchronize(self.runner.device)  # the given tensors are free once this returns
            if lora is not None and (base or adapters):
                if base:
                    lora.clear()  # a new W: the adapters were trained on the old one
                if adapters:
                    lora.add(version, adapters, self.config.torch_dtype, self.runner.device)
        self.weight_version = version
        pinned = bool(adapters) and not base and self.config.kv_on_update == "keep"
        self.num_version_moves += repin((seq for seqs in self.requests.values() for seq in seqs), version,
                                        lora.versions if pinned else None)
        if self.config.kv_on_update == "recompute":
            self.scheduler.drop_kv()
            self.sessions.drop_kv()
        if not (adapters and not base):
            self.block_manager.reset_prefix_cache()

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        images: list[list[ImageInput]] | None = None,
    ) -> list[RequestOutput]:
        """Offline generation: run every prompt (with its images, if given) to completion, outputs in prompt order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        outputs: dict[str, RequestOutput] = {}
        for prompt, p, prompt_images_ in zip(prompts, params_list, images or [()] * len(prompts), strict=True):
            request_id = f"generate-{next(self._request_ids)}"
            self.add_request(request_id, prompt, p, prompt_images_)
            outputs[request_id] = RequestOutput(request_id, list(prompt), [Completion(i) for i in range(p.n)])
        while any(output.request_id in self.requests for output in outputs.values()):
            for token in self.step():
                if token.request_id in outputs:
                    outputs[token.request_id].completions[token.index].add(token)
        return list(outputs.values())

    @property
    def stats(self) -> dict[str, int | float]:
        """Gauges for metrics: running and waiting sequences, free KV blocks (cached ones nobody holds included),
        preemptions and prefill tokens so far, the tokens looked up in the prefix cache so far and those it
        supplied (hit rate = hits / queried), open sessions and the blocks they hold between turns, their KV
        evictions and expiries, the KV cache's bytes per token as stored (config.kv_cache_dtype says how), the host
        tier's counters (HostKVTier.stats; zeros without one) and turns whose tiered KV found no room, and the session
        admission queue's (Admission.stats)."""
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "free_blocks": self.block_manager.num_free_blocks,
            "num_blocks": self.block_manager.num_blocks,
            "preemptions": self.scheduler.num_preemptions,
            "prefill_tokens": self.step_stats.num_prefill_tokens,
            "prefix_cache_queried_tokens": self.block_manager.num_queried_tokens,
            "prefix_cache_hit_tokens": self.block_manager.num_hit_tokens,
            "lora_versions_resident": len(self.runner.adapters.versions) if self.runner.adapters is not None else 0,
            "policy_version_moves": self.num_version_moves,
            "sessions": len(self.sessions.sessions),
            "session_blocks": self.sessions.num_blocks_held,
            "session_evictions": self.sessions.num_evictions,
            "sessions_expired": self.sessions.num_expired,
            "kv_evicted_tokens": self.evictor.num_evicted_tokens if self.evictor is not None else 0,
            "kv_cache_bytes_per_token": self.config.kv_bytes_per_block / self.config.block_size,
            **(self.sessions.tier.stats if self.sessions.tier is not None else dict.fromkeys(TIER_STATS, 0)),
            "session_tier_misses": self.sessions.num_tier_misses,
            **self.sessions.admission.stats,
        }

    def _postprocess(self, seqs: list[Sequence], token_ids: list[int], logprobs: list[float]) -> list[TokenOutput]:
        outputs = []
        for seq, token_id, logprob in zip(seqs, token_ids, logprobs):
            seq.append(token_id, logprob, seq.policy_version)
            reason = self._finish_reason(seq, token_id)
            kv_version = routes = None
            if reason is not None:
                kv_version, routes = seq.kv_version, seq.routed_experts
                seq.finish_reason = reason
                self._finish(seq)
                if all(s.is_finished for s in self.requests[seq.request_id]):
                    del self.requests[seq.request_id]
            outputs.append(TokenOutput(seq.request_id, seq.index, token_id, logprob, seq.policy_version, reason,
                                       kv_version, routes))
        return outputs

    def _finish(self, seq: Sequence) -> None:
        session = seq.session
        self.scheduler.finish(seq)
        if session is not None:
            self.sessions.end_turn(seq)

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


def host_tier(config: EngineConfig, cache) -> HostKVTier | None:
    """The host tier of config.session_kv_tier_bytes over `cache` (rollout/kv/host_tier.py); None when 0."""
    if not config.session_kv_tier_bytes:
        return None
    m = config.model_config
    return HostKVTier(cache, config.session_kv_tier_bytes, config.session_kv_tier_codec, config.block_size,
                      m.num_layers, m.num_kv_heads, m.head_dim, config.torch_dtype)
