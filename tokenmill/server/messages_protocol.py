"""The Anthropic Messages API shapes (/v1/messages, /v1/messages/count_tokens, as vLLM and SGLang serve them):
pydantic models for the request, msgspec Structs for the message, its content blocks and its stream events.

Same conventions as tokenmill/api/protocol.py: a request accepts unknown fields (logged as ignored), a wrong type
is a 400 naming the field, and a field tokenmill cannot honour is declared "off" only. Content blocks are text,
tool_use, tool_result and thinking; images and documents need a vision model, and are refused by the schema."""
from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec
from pydantic import Field

from tokenmill.api.protocol import INT64_MAX, AnthropicErrorResponse, Int, _Body, _Request

# ============================== request ==============================


class CacheControl(_Request):
    """Anthropic's prompt-caching breakpoint. Accepted and needed by nobody: the prefix cache keeps every prompt's
    blocks without being asked, so a marked prefix is reused as any other is."""
    type: Literal["ephemeral"] = "ephemeral"
    ttl: str | None = None


class TextBlockParam(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ContentBlockParam(_Request):
    """One block of a message's content, every kind in one flat model: text (text), tool_use (id, name, input: an
    earlier call of the assistant's), tool_result (tool_use_id, content: the user's answer to it; is_error: the
    call failed, which its text says to the model), thinking and redacted_thinking (earlier reasoning, which chat
    templates drop, as they drop reasoning_content)."""
    type: Literal["text", "tool_use", "tool_result", "thinking", "redacted_thinking"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[TextBlockParam] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None
    cache_control: CacheControl | None = None


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockParam]


class ToolParam(_Request):
    """A client tool (Anthropic's server tools, such as web search, have a `type` of their own: refused)."""
    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoiceParam(_Request):
    """auto (the model decides), any (at least one call: chat's "required"), tool (this one: chat's named
    function), none; disable_parallel_tool_use is chat's parallel_tool_calls false."""
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingParam(_Request):
    """enabled: the chat template's enable_thinking, and budget_tokens as vLLM's thinking_token_budget (a reasoning
    model only: --reasoning-parser); adaptive (the model decides, with no budget): a reasoning model thinks, another
    does not; disabled: enable_thinking false, and no thinking blocks."""
    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: Int | None = Field(default=None, ge=1, le=INT64_MAX)


class MetadataParam(_Request):
    user_id: str | None = None  # OpenAI's `user`: on the request's log line and trace span


class MessagesInput(_Body):
    """What a prompt is made of: /v1/messages/count_tokens takes just this."""
    _UNSUPPORTED: ClassVar[dict[str, str]] = {
        "mcp_servers": "", "container": "", "context_management": ""}
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    mcp_servers: None = None  # servers this one would have to call: not supported
    container: None = None
    context_management: None = None


class MessagesRequest(MessagesInput):
    max_tokens: Int = Field(ge=1, le=INT64_MAX)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: Int | None = Field(default=None, ge=-1, le=INT64_MAX)  # -1 or 0: off (vLLM's)
    metadata: MetadataParam | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here: both are what it serves


# ============================== response ==============================


class TextBlock(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class MessageUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int


class Message(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    role: str = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: str | None = None  # end_turn, max_tokens, stop_sequence, tool_use
    stop_sequence: str | None = None
    usage: MessageUsage


class TokenCount(msgspec.Struct):
    input_tokens: int


# ---- stream events: the tag names the event; the SSE frame repeats it in its `event:` line ----

class MessageStartEvent(msgspec.Struct, tag_field="type", tag="message_start"):
    message: Message


class ContentBlockStartEvent(msgspec.Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: ContentBlock


class TextDelta(msgspec.Struct, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, tag_field="type", tag="thinking_delta"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag_field="type", tag="signature_delta"):
    signature: str


class InputJsonDelta(msgspec.Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDeltaEvent(msgspec.Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class ContentBlockStopEvent(msgspec.Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDetails(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class OutputUsage(msgspec.Struct):
    output_tokens: int


class MessageDeltaEvent(msgspec.Struct, tag_field="type", tag="message_delta"):
    delta: StopDetails
    usage: OutputUsage


class MessageStopEvent(msgspec.Struct, tag_field="type", tag="message_stop"):
    pass


# every event a /v1/messages stream sends (tokenmill/server/openapi.py documents the stream with them)
STREAM_EVENTS = (MessageStartEvent, ContentBlockStartEvent, ContentBlockDeltaEvent, ContentBlockStopEvent,
                 MessageDeltaEvent, MessageStopEvent, AnthropicErrorResponse)
