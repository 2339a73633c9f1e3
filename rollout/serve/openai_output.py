"""Engine deltas -> the OpenAI endpoint's response bodies, whole or as server-sent event chunks.

A Choice gathers one completion's deltas: its tokens exactly as generated, and its text settled as far
as later tokens cannot change it (stop strings cut, as OpenAI leaves them out; tool calls parsed out
when the request gave tools). The shapes follow OpenAI's API, plus per choice `token_ids` and
`weight_versions` (the policy version of each token), and on its last delta, of a mixture-of-experts model,
`routed_experts` ([tokens][sparse layers][top_k] over prompt + completion but the last token; routing replay).
"""

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout.engine.outputs import Completion
from rollout.engine.sequence import FinishReason
from rollout.serve.tool_calls import ToolCall, ToolCallParser

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}


@dataclass
class Update:
    """What one delta settled for one choice."""

    choice: "Choice"
    pieces: list[str | ToolCall]  # content and tool calls, in order
    delta: Completion


@dataclass
class Choice:
    index: int
    decode: Callable[[list[int]], str]
    stops: tuple[str, ...]
    parser: ToolCallParser | None  # None: tool-call tags stay content
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    routed_experts: Any = None  # of the finished completion (Completion.routed_experts)
    pieces: list[str | ToolCall] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    text: str = ""  # the decoded text, as far as its last character is complete
    settled_chars: int = 0  # characters of `text` settled
    prefix_offset: int = 0  # token_ids[prefix_offset:read_offset] are decoded again as context for the next ones
    read_offset: int = 0  # token_ids before it are in `text`

    def take(self, delta: Completion) -> Update:
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs
        self.weight_versions += delta.weight_versions
        self.finish_reason = delta.finish_reason
        self.routed_experts = delta.routed_experts
        final = delta.finish_reason is not None
        self._detokenize(final)
        text = self._settle(final)
        if self.parser is None:
            pieces = [text] if text else []
        else:
            pieces = self.parser.feed(text) + (self.parser.finish() if final else [])
        self.pieces += pieces
        return Update(self, pieces, delta)

    def whole(self) -> Update:
        """Everything so far as one update (a reply that is not streamed)."""
        return Update(self, self.pieces, Completion(self.index, self.token_ids, self.logprobs, self.weight_versions,
                                                    self.finish_reason, routed_experts=self.routed_experts))

    def content_and_calls(self) -> tuple[str, list[ToolCall]]:
        return _content(self.pieces), _calls(self.pieces)

    @property
    def openai_finish_reason(self) -> str | None:
        if self.finish_reason == FinishReason.STOP and _calls(self.pieces):
            return "tool_calls"
        return FINISH_REASONS.get(self.finish_reason)

    def _detokenize(self, final: bool) -> None:
        """Decode only what the new tokens add, with the tokens before them as context (vLLM's prefix and read
        offsets): the text of token_ids[prefix_offset:read_offset] is already in `text`, so whatever the decode of
        token_ids[prefix_offset:] adds beyond it is new, unless it ends in an incomplete character, which waits
        for the next token. Each delta costs its own tokens and a few before them, never the whole completion."""
        prefix = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        window = self.decode(self.token_ids[self.prefix_offset:])
        if final or (len(window) > len(prefix) and not window.endswith("\ufffd")):
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)

    def _settle(self, final: bool) -> str:
        """New text no later token can change: a stop string and what follows it are cut; before the end, a
        tail that may begin one, or an incomplete character, is held back. No stop string begins before the
        settled text, so the search starts there."""
        text = self.text
        end = min((at for at in (text.find(stop, self.settled_chars) for stop in self.stops) if at >= 0),
                  default=len(text))
        if not final:
            end = min(end, len(text) - max((len(stop) - 1 for stop in self.stops), default=0))
            while end > self.settled_chars and text[end - 1] == "\ufffd":
                end -= 1
        end = max(end, self.settled_chars)
        new, self.settled_chars = text[self.settled_chars:end], end
        return new


@dataclass
class Reply:
    """The response to one request being built: header fields and choices."""

    id: str
    object: str  # "text_completion" or "chat.completion"
    model: str
    prompt_tokens: int  # a session turn: the tokens this call added to the context
    choices: list[Choice]
    with_logprobs: bool
    chat: bool
    created: int = field(default_factory=lambda: int(time.time()))

    def take(self, delta: Completion) -> Update:
        return self.choices[delta.index].take(delta)

    def header(self, chunk: bool = False) -> dict:
        return {"id": self.id, "object": f"{self.object}.chunk" if chunk else self.object, "created": self.created,
                "model": self.model}

    def usage(self) -> dict:
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def body(self) -> dict:
        return {**self.header(), "choices": [self._shape(c.whole(), whole=True) for c in self.choices],
                "usage": self.usage()}

    def chunk(self, update: Update) -> dict:
        return {**self.header(chunk=True), "choices": [self._shape(update, whole=False)]}

    def usage_chunk(self) -> dict:
        return {**self.header(chunk=True), "choices": [], "usage": self.usage()}

    def _shape(self, update: Update, whole: bool) -> dict:
        choice, delta = update.choice, update.delta
        tokens = [choice.decode([t]) for t in delta.token_ids] if self.with_logprobs else []
        out = {"index": choice.index}
        if self.chat:
            out.update(_chat_message(update, whole))
            if self.with_logprobs:
                out["logprobs"] = {"content": [chat_logprob(t, lp) for t, lp in zip(tokens, delta.logprobs)],
                                   "refusal": None}
        else:
            out["text"] = _content(update.pieces)
            if self.with_logprobs:
                earlier = choice.token_ids[:len(choice.token_ids) - len(delta.token_ids)]
                out["logprobs"] = completion_logprobs(tokens, delta.logprobs, len(choice.decode(earlier)))
        out.setdefault("logprobs", None)
        out["finish_reason"] = choice.openai_finish_reason if delta.finish_reason is not None else None
        out["token_ids"], out["weight_versions"] = delta.token_ids, delta.weight_versions
        if delta.routed_experts is not None:
            out["routed_experts"] = delta.routed_experts.tolist()
        return out


def _chat_message(update: Update, whole: bool) -> dict:
    """{"message": ...} of a whole reply, or {"delta": ...} of a chunk (the first one says the role)."""
    content, calls = _content(update.pieces), _calls(update.pieces)
    if whole:
        message = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [c.to_openai() for c in calls]
        return {"message": message}
    choice = update.choice
    delta = {"role": "assistant"} if len(choice.token_ids) == len(update.delta.token_ids) else {}
    if content:
        delta["content"] = content
    if calls:
        before = len(_calls(choice.pieces)) - len(calls)
        delta["tool_calls"] = [{"index": before + i, **c.to_openai()} for i, c in enumerate(calls)]
    return {"delta": delta}


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def chat_logprob(token: str, logprob: float) -> dict:
    """One entry of a chat choice's logprobs.content: the sampled token only (top_logprobs stays empty)."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}


def completion_logprobs(tokens: list[str], logprobs: list[float], offset: int) -> dict:
    """A completion choice's logprobs (the legacy shape); text_offset counts from `offset` characters."""
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}


def sse(payload: dict) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload)}\n\n"


def _content(pieces: list[str | ToolCall]) -> str:
    return "".join(p for p in pieces if isinstance(p, str))


def _calls(pieces: list[str | ToolCall]) -> list[ToolCall]:
    return [p for p in pieces if isinstance(p, ToolCall)]
