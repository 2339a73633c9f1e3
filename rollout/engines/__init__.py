"""Rollout engines behind one interface (base.py), chosen by `engine.type` (settings.py).

start_engine is the only place that looks at the type; heavy imports (torch, vllm, sglang) happen inside it.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout.engines.base import RolloutEngine
    from rollout.engines.settings import EngineChoice


def start_engine(model: str, settings: "EngineChoice") -> "RolloutEngine":
    """The engine `settings` names, serving the Hugging Face folder `model`, ready for requests."""
    values = settings.model_dump()
    kind = values.pop("type")
    threads = values.pop("torch_threads", None)
    if values.pop("deterministic", False):
        from services.determinism import use_deterministic_torch

        use_deterministic_torch(threads)
    elif threads is not None:
        import torch

        torch.set_num_threads(threads)
    if kind == "native":
        from rollout.config import EngineConfig
        from rollout.engine.async_engine import AsyncEngine
        from rollout.engine.llm_engine import LLMEngine

        return AsyncEngine(LLMEngine(EngineConfig(model=model, **values)))
    if kind == "vllm":
        from rollout.engines.vllm_engine import start_vllm

        return start_vllm(model, settings)
    from rollout.engines.sglang_engine import SglangEngine

    return SglangEngine(model, settings)
