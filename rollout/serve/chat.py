"""Chat messages to token ids with the model's chat template, for sessions and the OpenAI endpoint.

A session's context is never re-rendered: each call renders only what it adds. `render_prompt` renders a
conversation's start with the generation prompt. `render_continuation` renders messages that follow an
assistant turn the engine generated: it is the template's text after a closed assistant message (found by
rendering a stand-in conversation with and without the new messages), so the generated tokens stay as
they were and the new tokens read as the template would have put them.
"""

from collections.abc import Sequence

_STAND_IN = [{"role": "user", "content": "relayrl-user"}, {"role": "assistant", "content": "relayrl-assistant"}]


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template; give token ids or text instead (FAILED_PRECONDITION)."""


def render_prompt(tokenizer, messages: Sequence[dict], tools: list | None = None) -> list[int]:
    """Token ids of `messages` rendered with the chat template, ending with the assistant's generation prompt."""
    text = _render(tokenizer, list(messages), tools, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids


def render_continuation(tokenizer, messages: Sequence[dict], turn_closed: bool, tools: list | None = None) -> list[int]:
    """Token ids to append after a generated assistant turn: `messages` as the template continues the
    conversation, ending with the next generation prompt.

    `turn_closed`: the turn ended with an end-of-turn token (eos or a stop token), which is then already in
    the context; otherwise the template's end of an assistant message comes first.
    """
    if not messages:
        raise ValueError("messages: must not be empty")
    closed = _render(tokenizer, _STAND_IN, tools, add_generation_prompt=False)
    full = _render(tokenizer, _STAND_IN + list(messages), tools, add_generation_prompt=True)
    if not full.startswith(closed):
        raise ValueError("the chat template renders earlier messages differently once more follow; "
                         "append token ids or text instead of messages")
    text = full[len(closed):]
    end_of_turn = closed[closed.rindex(_STAND_IN[-1]["content"]) + len(_STAND_IN[-1]["content"]):]
    if turn_closed:
        eos = tokenizer.eos_token or ""
        if eos and end_of_turn.startswith(eos):
            text = end_of_turn[len(eos):] + text
    else:
        text = end_of_turn + text
    return tokenizer(text, add_special_tokens=False).input_ids


def _render(tokenizer, messages: list[dict], tools: list | None, add_generation_prompt: bool) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("the model's tokenizer has no chat template: give token ids or text, not messages")
    if not messages:
        raise ValueError("messages: must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise ValueError(f"messages[{i}].role: must be a non-empty string")
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
