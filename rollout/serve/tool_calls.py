"""Tool calls in generated text: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` -> OpenAI fields.

The chat templates of the models we serve (Qwen's, and the tiny one in rollout/model/tiny.py) render an
assistant's tool calls after its content in that form, so a model learns to write them so. The parser
reads the text as it streams: text outside the tags is content; a closed tag whose body is a JSON
object with a string "name" and an object "arguments" is a tool call; any other tag, or one never
closed, stays plain content, exactly as generated.
"""

import json
import uuid
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str

    def to_openai(self) -> dict:
        """OpenAI's shape: arguments travel as a JSON string."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


def parse_tool_call(body: str) -> ToolCall | None:
    """The call a tag's body holds, or None when it is not one (bad JSON, no name, arguments not an object)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str) and isinstance(value.get("arguments"), dict)):
        return None
    return ToolCall(value["name"], value["arguments"], f"call_{uuid.uuid4().hex[:24]}")


class ToolCallParser:
    """Split streamed text into content and tool calls.

    feed() and finish() return the pieces that are settled, in order: a str (content) or a ToolCall.
    Text that may still turn into a tool call (an open tag, or a tail that could begin one) is held back.
    """

    def __init__(self) -> None:
        self._pending = ""

    def feed(self, text: str) -> list[str | ToolCall]:
        self._pending += text
        pieces: list[str | ToolCall] = []
        while self._pending:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _partial_open_len(self._pending)
                pieces.append(self._pending[:len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep:]
                break
            pieces.append(self._pending[:start])
            end = self._pending.find(CLOSE, start + len(OPEN))
            if end < 0:
                self._pending = self._pending[start:]
                break
            raw = self._pending[start:end + len(CLOSE)]
            pieces.append(parse_tool_call(self._pending[start + len(OPEN):end]) or raw)
            self._pending = self._pending[end + len(CLOSE):]
        return _joined(pieces)

    def finish(self) -> list[str | ToolCall]:
        """Whatever is held back, as content (an unclosed tag is not a call)."""
        rest, self._pending = self._pending, ""
        return [rest] if rest else []


def split_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """A whole reply -> (its content, its tool calls)."""
    parser = ToolCallParser()
    pieces = parser.feed(text) + parser.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [p for p in pieces if isinstance(p, ToolCall)]


def _partial_open_len(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of the open tag."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def _joined(pieces: list[str | ToolCall]) -> list[str | ToolCall]:
    """Adjacent content merged, empty content dropped."""
    out: list[str | ToolCall] = []
    for piece in pieces:
        if isinstance(piece, str):
            if not piece:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += piece
                continue
        out.append(piece)
    return out
