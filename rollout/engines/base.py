"""The one engine interface the rollout service, the weight receiver and sessions use.

Three implementations sit behind it, chosen by `engine.type` in the rollout service's config
(rollout/engines/settings.py): `native` (rollout.engine.async_engine.AsyncEngine, the embedded default and the
reference), `vllm` (rollout/engines/vllm_engine.py) and `sglang` (rollout/engines/sglang_engine.py).
The service code never branches on the engine beyond that choice: what differs between engines is here,
as methods, or in ModelInfo, as facts.

Every generated token carries its logprob and the weight version that produced it; refusals raise the
errors of rollout/engine/errors.py (InvalidRequest, QueueFull, DuplicateRequest, the session errors), which the
service maps to status codes; an engine that stopped raises rollout.engine.errors.EngineDead.
"""

import asyncio
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Protocol

import torch

from rollout.engine.model_info import Layout, ModelInfo
from rollout.engine.outputs import Completion
from rollout.engine.sampling_params import SamplingParams
from rollout.engine.sessions import SessionRecord, SessionState
from services.weights import GroupSpec, Manifest


class RolloutEngine(Protocol):
    """Generation with per-token logprobs and versions, abort, logprobs of given tokens, weight updates,
    sessions and model info, driven from one asyncio event loop (the server's)."""

    tokenizer: object  # a transformers tokenizer of the served model

    @property
    def info(self) -> ModelInfo: ...

    @property
    def weight_version(self) -> int:
        """The version new tokens are generated with."""
        ...

    @property
    def stats(self) -> dict[str, int | float]:
        """Counters for the metrics (keys as AsyncEngine's; an engine reports those it knows)."""
        ...

    def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> AsyncIterator[Completion]:
        """Deltas of the request's n completions as they are produced; leaving early aborts the request."""
        ...

    async def generate_all(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams) -> list[Completion]:
        """The n completions, in index order, once all have finished (an abort keeps partial output)."""
        ...

    async def generate_all_many(self, requests: Sequence[tuple[str, Sequence[int], SamplingParams]]
                                ) -> list[list[Completion]]:
        """generate_all of each (request id, prompt ids, params), started together where the engine can (the native
        engine: in one step, in order). A refusal raises like generate_all, `request_index` naming the request."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Abort a request (or a session's running turn, by session id); whether it was running."""
        ...

    async def compute_logprobs(self, prompt_ids: Sequence[int], responses: Sequence[Sequence[int]],
                               temperature: float = 1.0) -> tuple[list[list[float]], int]:
        """Logprobs of each response's tokens given the prompt under softmax(logits / temperature), and the
        weight version used."""
        ...

    async def top_logprobs(self, prompt_ids: Sequence[int], response_ids: Sequence[int], temperature: float,
                           top: int) -> list[list[tuple[int, float]]]:
        """The `top` most likely (token id, logprob) at each position of a response."""
        ...

    @property
    def device(self) -> torch.device:
        """Where received weights are staged (with the CUDA index): the weight receiver's and KV group's device."""
        ...

    def parameter_layout(self) -> Layout:
        """name -> (shape, dtype) of every tensor a weight update carries (Hugging Face names)."""
        ...

    async def update_weights(self, weights: dict[str, torch.Tensor], version: int, adopt: bool = False) -> float:
        """Serve `weights` (every tensor of parameter_layout) as `version` from the next step on; in-flight
        sequences continue under it, over their KV or recomputing it as the engine's kv_on_update says. With
        `adopt` the engine may keep the tensors themselves (the caller leaves them untouched until a later update).
        Returns the seconds the switch took."""
        ...

    @property
    def last_pause_s(self) -> float:
        """Seconds the last update_weights kept the engine from generating (from when it stopped stepping for the
        update until it could step again), measured by the engine: the weight receiver reports it (pause_s)."""
        ...

    async def watch_version(self, newer_than: int, wait_s: float) -> int:
        """The served version once it differs from `newer_than`, or after `wait_s` the version then."""
        ...

    async def open_session(self, session_id: str, prompt_ids: Sequence[int]) -> int: ...

    async def append_to_session(self, session_id: str, token_ids: Sequence[int],
                                turn_reward: float | None = None) -> int: ...

    def generate_in_session(self, session_id: str, params: SamplingParams, whole: bool = False,
                            expected_idle_s: float | None = None) -> AsyncIterator[Completion]: ...

    async def session_state(self, session_id: str) -> SessionState: ...

    async def session_tool(self, session_id: str, tool: str) -> None:
        """The session's last turn called `tool`: an engine that schedules idle sessions' KV learns each tool's wait."""

    async def close_session(self, session_id: str) -> SessionRecord: ...

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop serving; open streams end with EngineDead."""
        ...


class KeepsItsOwnSessionKV:
    """Mixed into an engine whose own cache keeps its sessions' KV (SGLang's radix cache): nothing to schedule."""

    async def session_tool(self, session_id: str, tool: str) -> None:
        """Nothing to learn: the engine does not schedule its sessions' KV."""


class ReceivesFromGroup(Protocol):
    """What an engine that joins the trainer's weight-update group itself adds (SGLang, whose scheduler receives
    into GPU memory): the weight receiver uses it instead of update_weights when `receives_from_group` is true."""

    receives_from_group: bool

    async def join_weight_group(self, spec: GroupSpec) -> None:
        """Join the group `spec` names as its rank `spec.rank` (formed as torch.distributed forms a named group)."""
        ...

    async def receive_weights(self, manifest: Manifest, group_name: str) -> None:
        """Receive every tensor of `manifest`, one broadcast each in slot order, and load them."""
        ...

    async def serve_received(self, version: int) -> float:
        """Tag tokens with `version` from now on (the received weights are loaded); seconds it took."""
        ...

    async def leave_weight_group(self, group_name: str) -> None:
        """Forget the group (after a failure, or when the trainer forms a new one)."""
        ...


async def generate_each(engine: RolloutEngine, requests: Sequence[tuple[str, Sequence[int], SamplingParams]]
                        ) -> list[list[Completion]]:
    """generate_all_many as concurrent generate_all calls, for an engine that cannot add requests together. A
    refusal's `request_index` names its request; the other calls are cancelled (each aborts its request)."""
    tasks = [asyncio.ensure_future(engine.generate_all(*request)) for request in requests]
    try:
        return await asyncio.gather(*tasks)
    except Exception as exc:
        exc.request_index = next(i for i, task in enumerate(tasks)
                                 if task.done() and not task.cancelled() and task.exception() is exc)
        raise
    finally:  # a refusal, or the caller gone: the other requests are aborted (each wait aborts its own)
        for task in tasks:
            task.cancel()
            task.add_done_callback(lambda task: task.cancelled() or task.exception())  # outcome seen: no warning


def checkpoint_layout(model: str, dtype: torch.dtype) -> Layout:
    """name -> (shape, dtype) of the tensors in a Hugging Face folder's safetensors files, as served in `dtype`:
    the layout of a weight update to an engine that loads checkpoint-named tensors (vLLM, SGLang)."""
    from safetensors import safe_open

    layout = {}
    for path in sorted(Path(model).glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                layout[name] = (tuple(f.get_slice(name).get_shape()), dtype)
    return layout
