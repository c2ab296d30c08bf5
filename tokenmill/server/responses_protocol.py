"""The OpenAI Responses API shapes (/v1/responses): pydantic models for the request, msgspec Structs for the
response object, its output items and its stream events.

Same conventions as tokenmill/api/protocol.py: a request accepts unknown fields (ignored), and a wrong type is a
400 naming the field; responses are Structs, encoded by msgspec. The request carries the shared SamplingFields
too, so that vLLM's sampling extras (top_k, seed, stop, ...) work here as on chat."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from pydantic import Field

from tokenmill.api.protocol import Int, ReasoningEffort, SamplingFields, _Request

# ============================== request ==============================


class TextFormat(_Request):
    """`text.format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", "name", "schema", ...}."""
    type: str = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: str | None = None


class InputContentPart(_Request):
    type: str  # input_text, output_text (an earlier answer sent back); images and files are not supported
    text: str | None = None


class InputItem(_Request):
    """One item of `input`, every kind in one flat model: a message (role, content), a function_call the model made
    (call_id, name, arguments), its function_call_output (call_id, output), or a reasoning item."""
    type: str = "message"
    role: str | None = None
    content: str | list[InputContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[InputContentPart] | None = None


class ReasoningConfig(_Request):
    """`reasoning`: effort is the chat template's `reasoning_effort`, as chat's reasoning_effort (vLLM's
    treatment of both); reasoning summaries are not produced, so `summary` must stay unset."""
    effort: ReasoningEffort | None = None
    summary: None = None
    generate_summary: None = None


class ResponsesRequest(SamplingFields):
    _UNSUPPORTED: ClassVar[dict[str, str]] = {
        "conversation": ": send its items as input", "prompt": ": send its text as input",
        "include": "", "max_tool_calls": "", "top_logprobs": ""}
    # the chat and completions extras that this endpoint does not read: refused, never ignored
    _UNSUPPORTED_VLLM: ClassVar[dict[str, str]] = {
        **SamplingFields._UNSUPPORTED_VLLM,
        **{name: " on /v1/responses" for name in (
            "stream_options", "prompt_logprobs", "return_token_ids", "return_tokens_as_token_ids",
            "truncate_prompt_tokens", "truncation_side", "use_beam_search", "kv_transfer_params")}}
    kv_transfer_params: None = None  # disaggregated prefill/decode serves completions and chat only
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Int | None = Field(default=None, ge=1)
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None  # flat: {"type": "function", "name", "description", "parameters"}
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", "name"}
    parallel_tool_calls: bool = True
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False  # answered at once, queued; GET it later (needs store)
    conversation: None = None  # server-side objects that tokenmill does not keep
    prompt: None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    # OpenAI's: "auto" drops the oldest input items until the prompt fits the context; "disabled", a 400
    truncation: Literal["auto", "disabled"] | None = "disabled"
    include: Annotated[list[str], Field(max_length=0)] | None = None
    max_tool_calls: None = None
    top_logprobs: Literal[0] | None = None
    # SamplingFields' chat and completions extras, declared "off" here (the schema says so)
    stream_options: None = None
    prompt_logprobs: None = None
    return_token_ids: Literal[False] | None = None
    return_tokens_as_token_ids: Literal[False] | None = None
    truncate_prompt_tokens: None = None
    truncation_side: None = None
    use_beam_search: Literal[False] = False


# ============================== response ==============================


class OutputText(msgspec.Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(msgspec.Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    status: str
    content: list[OutputText] = msgspec.field(default_factory=list)
    role: str = "assistant"


class FunctionCallItem(msgspec.Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ReasoningItem(msgspec.Struct, tag_field="type", tag="reasoning", kw_only=True):
    id: str
    status: str
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    summary: list = msgspec.field(default_factory=list)


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(msgspec.Struct):
    reason: str  # "max_output_tokens"


class ResponseObject(msgspec.Struct, kw_only=True):
    """The response; the request's settings are echoed, as OpenAI does (the SDK's Response needs several)."""
    id: str
    created_at: int
    model: str
    status: str  # "queued" | "in_progress" | "completed" | "incomplete" | "cancelled" | "failed"
    output: list[OutputMessage | FunctionCallItem | ReasoningItem]
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    temperature: float
    top_p: float
    store: bool
    object: str = "response"
    completed_at: int | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    user: str | None = None
    background: bool = False
    truncation: str = "disabled"
    service_tier: str = "default"


# ---- stream events: `type` names the event; the SSE frame repeats it in its `event:` line ----

class LifecycleEvent(msgspec.Struct):
    """response.created, response.in_progress, response.completed, response.incomplete, response.failed."""
    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(msgspec.Struct):
    """response.output_item.added (the item as it starts), response.output_item.done (as it ends)."""
    type: str
    sequence_number: int
    output_index: int
    item: OutputMessage | FunctionCallItem | ReasoningItem


class ItemEvent(msgspec.Struct):
    """What every event about one output item starts with."""
    type: str
    sequence_number: int
    item_id: str
    output_index: int


class ContentPartEvent(ItemEvent):
    """response.content_part.added, response.content_part.done."""
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(ItemEvent, omit_defaults=True):
    """response.output_text.delta (with logprobs, always [] here), response.reasoning_text.delta."""
    content_index: int
    delta: str
    logprobs: list | None = None


class TextDoneEvent(ItemEvent, omit_defaults=True):
    """response.output_text.done, response.reasoning_text.done."""
    content_index: int
    text: str
    logprobs: list | None = None


class ArgumentsDeltaEvent(ItemEvent):
    """response.function_call_arguments.delta."""
    delta: str


class ArgumentsDoneEvent(ItemEvent):
    """response.function_call_arguments.done."""
    name: str
    arguments: str


# every event a /v1/responses stream sends (tokenmill/server/openapi.py documents the stream with them)
class ErrorEvent(msgspec.Struct):
    """error: the stream failed after it began (the engine died); response.failed follows it."""
    type: str
    sequence_number: int
    code: str | None
    message: str
    param: str | None


STREAM_EVENTS = (LifecycleEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent, TextDoneEvent,
                 ArgumentsDeltaEvent, ArgumentsDoneEvent, ErrorEvent)
