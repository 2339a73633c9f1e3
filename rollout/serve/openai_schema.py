"""The OpenAI-compatible endpoint's request bodies, validated (responses: rollout/serve/openai_output.py).

Requests follow OpenAI's API; fields we do not serve are ignored when their value changes nothing
(user, metadata, parallel_tool_calls, ...) and refused with a 400 naming them when it would (echo,
penalties, logit_bias, chat's top-k alternatives). Extensions, as vLLM has them: top_k, ignore_eos,
stop_token_ids.
"""

import hashlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.config import Strict
from services.net import is_loopback

_UNSERVED = "is not supported by this server"


class OpenAISettings(Strict):
    """`openai:` in the rollout service's config: the OpenAI-compatible HTTP endpoint (off when absent)."""

    host: str = Field("127.0.0.1", description="Interface to bind. The endpoint has no auth: beyond loopback it "
                      "refuses to start unless `insecure`.")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 picks a free one (logged).")
    served_model_name: str | None = Field(None, description="The `model` requests name; None: the model folder.")
    session_by_key: bool = Field(False, description="The bearer API key is the session key of chat calls (for "
                                 "frameworks that cannot send headers); an X-Session-Id header always is one.")
    max_logprobs: int = Field(20, ge=0, description="Most top-k alternatives a completion may ask for (`logprobs`); "
                              "they come from one extra scoring pass over the prompt and completion (as vLLM, 20).")
    retry_after_s: int = Field(1, ge=0, description="Retry-After of 429 (engine queue full) and 503 (engine stopped).")
    grace_s: float = Field(5.0, ge=0, description="On stop, how long open requests may run before they are cut.")
    insecure: bool = Field(False, description="Serve a non-loopback host although anyone reaching it may call it.")

    @model_validator(mode="after")
    def _loopback_unless_insecure(self) -> "OpenAISettings":
        if not (self.insecure or is_loopback(self.host)):
            raise ValueError(f"host {self.host!r} is reachable beyond this machine and the endpoint has no auth: "
                             "bind loopback, or set openai.insecure=true to serve it open anyway")
        return self


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Request(BaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    top_k: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float) -> float:
        if value != 0:
            raise ValueError(f"a nonzero penalty {_UNSERVED}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value: dict | None) -> dict | None:
        if value:
            raise ValueError(_UNSERVED)
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[int]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value: Any) -> Any:
        if isinstance(value, list) and value and not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
            raise ValueError("one prompt per request: a string or a list of token ids")
        return value

    @field_validator("logprobs")
    @classmethod
    def _not_negative(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value}")
        return value

    @field_validator("echo", "suffix")
    @classmethod
    def _unserved(cls, value: Any) -> Any:
        if value:
            raise ValueError(_UNSERVED)
        return value

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"best_of > 1 {_UNSERVED}; ask for n completions")
        return value


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str = ""
    type: str = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, value: str | list[dict] | None) -> str | list[dict] | None:
        if isinstance(value, list) and any(part.get("type") not in ("text", "image_url") for part in value):
            raise ValueError("only text and image_url content parts are served")
        return value

    @property
    def text(self) -> str:
        return self.text_with("")

    @property
    def image_urls(self) -> list[str]:
        """The URLs of its image_url parts, in order ({"type": "image_url", "image_url": {"url": ...}})."""
        if not isinstance(self.content, list):
            return []
        return [str((part.get("image_url") or {}).get("url", "")) for part in self.content
                if part.get("type") == "image_url"]

    def text_with(self, image_text: str) -> str:
        """Its text, each image part written as `image_text` (the model's image placeholder; "" leaves it out)."""
        if isinstance(self.content, list):
            return "".join(image_text if part.get("type") == "image_url" else str(part.get("text", ""))
                           for part in self.content)
        return self.content or ""

    def for_template(self, image_text: str = "") -> dict:
        """The message as chat templates read it (content a string, images as `image_text`; tool-call arguments as
        given)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text_with(image_text)}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": c.function.model_dump()}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def key(self) -> tuple:
        """What must match when a session's history is sent again: role, text, calls (arguments parsed), ids, images."""
        calls = tuple((c.function.name, _canonical(c.function.arguments)) for c in self.tool_calls or ())
        images = tuple(hashlib.sha256(url.encode()).hexdigest()[:16] for url in self.image_urls)
        return self.role, self.text, calls, self.tool_call_id or "", images


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _sampled_only(cls, value: int | None) -> int | None:
        if value:
            raise ValueError(f"top-{value} alternatives {_UNSERVED}; logprobs: true gives each sampled token's logprob")
        return value

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: float | None = Field(None, description="The episode's reward (the sample's), used at close unless "
                                 "close gives one.")
    turn_reward: float | None = Field(None, description="Reward of the turn that just ended (Sample.turn_rewards).")


class CloseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: float | None = Field(None, description="The episode's reward; default: the last one set, else 0.")
    submit: bool = Field(False, description="Put the sample into the rollout's configured buffer.")
    group_id: str = Field("", description="The sample's group (GRPO: the episodes of one task).")
    group_size: int = Field(0, ge=0, description="Episodes the group holds when complete (0: ungrouped).")


def _canonical(arguments: str | dict) -> str:
    """Tool-call arguments as one canonical JSON text (a client may send back a string or an object)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return json.dumps(arguments, sort_keys=True)
