"""vLLM's /tokenize and /detokenize: request bodies and responses."""
from __future__ import annotations

from typing import Annotated, Any

import msgspec
from pydantic import Field

from tokenmill.api.chat_protocol import ChatMessage
from tokenmill.api.protocol import Int, _Body


class TokenizeRequest(_Body):
    """vLLM's /tokenize: either a prompt, or chat messages rendered with the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[Annotated[Int, Field(ge=0)]]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str
