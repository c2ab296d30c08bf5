"""Chat messages → prompt text and token ids, through the tokenizer's chat template (the server renders a chat
request's prompt with it, the router the same prompt to predict its replica's prefix-cache hits)."""
from __future__ import annotations

import json
import re

from tokenmill.api.chat_protocol import ChatMessage
from tokenmill.sampling_params import ParamError
from tokenmill.tokenizer import encode


def _content_texts(message: ChatMessage, i: int) -> list[str]:
    content = message.content
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise ParamError(f"messages[{i}].content: only parts of type 'text' are supported, got {part.type!r}",
                             "messages")
        texts.append(part.text)
    return texts


def _content_text(message: ChatMessage, i: int) -> str:
    """A message's content as one string: a string as is, text parts joined by newlines."""
    return "\n".join(_content_texts(message, i))


# A template that loops over a message's content, `{% for part in message['content'] %}` (or message.content), expects
# OpenAI's list of parts: vLLM's test for --chat-template-content-format auto.
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\.content\b|\[\s*['\"]content['\"]\s*\])")


def content_format(template: str, flag: str = "auto") -> str:
    """--chat-template-content-format: string | openai, auto deciding by the template."""
    if flag != "auto":
        return flag
    return "openai" if _LOOPS_OVER_CONTENT.search(template or "") else "string"


def _arguments_as_objects(tool_calls: list[dict]) -> list[dict]:
    """Clients send assistant tool calls back with arguments as JSON text; chat templates expect objects."""
    out = []
    for call in tool_calls:
        call = dict(call)
        fn = call.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                call["function"] = {**fn, "arguments": json.loads(fn["arguments"])}
            except ValueError:
                pass  # not JSON: the template gets the text as sent
        out.append(call)
    return out


def to_template_messages(tokenizer, messages: list[ChatMessage], content_format_flag: str = "auto") -> list[dict]:
    """Validated, plain-dict messages for apply_chat_template. 'developer' becomes 'system' for templates that
    do not know it. Content is a string, or (content format openai) a list of {"type": "text", "text"} parts, a
    string content becoming one part, as vLLM passes it."""
    if not messages:
        raise ParamError("messages must contain at least one message", "messages")
    template = getattr(tokenizer, "chat_template", None) or ""
    map_developer = "developer" not in template
    as_parts = content_format(template, content_format_flag) == "openai"
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" and map_developer else m.role
        content = ([{"type": "text", "text": t} for t in _content_texts(m, i)] if as_parts
                   else _content_text(m, i))
        msg = {"role": role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls is not None:
            msg["tool_calls"] = _arguments_as_objects(m.tool_calls)
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def render_chat(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                tools: list[dict] | None = None, content_format_flag: str = "auto") -> tuple[str, list[int]]:
    """The prompt text and its token ids (the template writes the special tokens, so none are added).
    content_format_flag: --chat-template-content-format."""
    if continue_final_message and add_generation_prompt:
        raise ParamError("continue_final_message and add_generation_prompt cannot both be true; set "
                         "add_generation_prompt to false to continue the final message", "continue_final_message")
    conversation = to_template_messages(tokenizer, messages, content_format_flag)
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise ParamError("continue_final_message needs an assistant message last", "continue_final_message")
    kwargs = dict(chat_template_kwargs or {})
    if not kwargs.get("chat_template") and not getattr(tokenizer, "chat_template", None):
        raise ParamError("this model has no chat template; use /v1/completions", "messages")
    for reserved in ("tokenize", "add_generation_prompt", "continue_final_message", "conversation", "tools"):
        kwargs.pop(reserved, None)
    try:
        text = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, **kwargs)
    except Exception as e:  # jinja2 errors, or the template's own raise_exception
        raise ParamError(f"the chat template failed on these messages: {e}", "messages") from e
    return text, encode(tokenizer, text, add_special_tokens=False)
