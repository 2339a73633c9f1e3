"""The `moe:` section of the trainer config: routing replay (R3) and the load-balancing loss of a mixture-of-experts
policy (trainer/moe/). A dense policy ignores it."""

from typing import Literal

from pydantic import Field

from services.config import Strict


class MoeConfig(Strict):
    """How a mixture-of-experts policy routes its tokens in training (docs/moe.md)."""

    routing_replay: Literal["off", "rollout"] = Field(
        "off", description="rollout: every MoE layer runs, for each token, the experts the rollout engine routed it "
        "to (Sample.routed_experts), its router's gates taken at those experts, so the router still learns (R3; "
        "trainer/moe/routing.py); a sample without routes is an error (a dense model, or an engine that records "
        "none: vLLM, SGLang). off: the trainer's own routers choose.")
    aux_loss_coef: float = Field(
        0.0, ge=0, description="Weight of the load-balancing loss (moe/aux_loss in the metrics, Switch Transformer's "
        "per layer, 1 when balanced) added to the objective; 0 = reported, not trained on (as Qwen3 RL recipes).")
