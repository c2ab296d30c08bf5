"""/v1/chat/completions (and vLLM's /v1/chat/completions/batch): the messages, the request body, the response
and its streamed chunks."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType
from pydantic import Field, model_validator

from tokenmill.api.protocol import ROLES, Int, PromptLogprobs, ReasoningEffort, SamplingFields, Usage, _Request
from tokenmill.kv_transfer_params import KVTransferParams
from tokenmill.sampling_params import ParamError


class TextContentPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: Literal[ROLES]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields):
    _UNSUPPORTED: ClassVar[dict[str, str]] = {
        "functions": ": use tools", "function_call": ": use tool_choice", "audio": "",
        "modalities": ' (only ["text"])', "prediction": "", "web_search_options": ""}
    messages: list[ChatMessage]
    max_tokens: Int | None = Field(default=None, ge=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: Int | None = Field(default=None, ge=-1)  # -1: the whole vocabulary; at most --max-logprobs
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True
    include_reasoning: bool = True  # with a reasoning parser: False drops reasoning_content
    # vLLM extras for the chat template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # vLLM: the last message's content (if it is the assistant's) goes in front of the answer
    add_special_tokens: bool = False  # vLLM: special tokens (BOS) on top of what the chat template writes
    _UNSUPPORTED_VLLM: ClassVar[dict[str, str]] = {
        **SamplingFields._UNSUPPORTED_VLLM, "documents": "", "media_io_kwargs": "", "mm_processor_kwargs": "",
        "return_prompt_text": ""}
    documents: None = None
    chat_template: str | None = None  # vLLM's: this request's Jinja template (needs --trust-request-chat-template)
    media_io_kwargs: None = None
    mm_processor_kwargs: None = None
    reasoning_effort: ReasoningEffort | None = None  # the chat template's `reasoning_effort` (vLLM)
    return_prompt_text: Literal[False] | None = None
    functions: None = None
    function_call: None = None
    audio: None = None
    modalities: list[Literal["text"]] | None = Field(default=["text"], min_length=1, max_length=1)
    prediction: None = None
    web_search_options: None = None


def template_kwargs(kwargs: dict[str, Any] | None, reasoning_effort: str | None) -> dict[str, Any] | None:
    """vLLM's merge: the request's chat_template_kwargs, with reasoning_effort (when given) over them."""
    if reasoning_effort is None:
        return kwargs
    return {**(kwargs or {}), "reasoning_effort": reasoning_effort}


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch: the fields of a chat completion, with `messages` a list of
    conversations; one choice per conversation, index i for conversation i. As in vLLM: no streaming, no tools,
    n = 1 (refused with a 400 naming the field, never ignored)."""
    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(min_length=1)

    @model_validator(mode="after")
    def _batch_limits(self):
        for name, refused in (("stream", self.stream), ("tools", self.tools is not None), ("n", self.n != 1)):
            if refused:
                raise ParamError(f"Batch chat completions do not support `{name}`"
                                 f"{' > 1' if name == 'n' else ''}.", name)
        return self


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprobToken(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobToken]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatResponseMessage(msgspec.Struct, kw_only=True):
    """vLLM's ChatMessage: every OpenAI field present (null, or [] for tool_calls); reasoning_content only when the
    model reasoned."""
    role: str
    content: str | None  # null when the answer is only tool calls or only reasoning
    refusal: None = None
    annotations: None = None
    audio: None = None
    function_call: None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    reasoning_content: str | UnsetType = UNSET


class ChoiceEnd(msgspec.Struct, kw_only=True):
    """The fields a chat choice ends with, whole or streamed (always sent, null included)."""
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatChoice(ChoiceEnd):
    index: int
    message: ChatResponseMessage
    token_ids: list[int] | None = None  # vLLM: with return_token_ids


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A streamed piece of tool call `index`: the first carries id, type and name; the rest, argument text."""
    index: int
    function: DeltaFunctionCall
    id: str | None = None
    type: str | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(ChoiceEnd):
    """vLLM's stream choice: token_ids always there (this chunk's tokens with return_token_ids, else null), so that
    a client reading it as an attribute finds it."""
    index: int
    delta: DeltaMessage
    token_ids: list[int] | None = None


class ChatCompletionResponse(msgspec.Struct):
    """vLLM's whole response: every field present, null when not asked for (clients read them as attributes)."""
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    service_tier: None = None
    system_fingerprint: None = None
    # vLLM's extras
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None
    prompt_text: None = None  # return_prompt_text, which tokenmill refuses
    kv_transfer_params: KVTransferParams | None = None  # a prefill instance's: where a decode instance fetches


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | UnsetType = UNSET  # with stream_options.continuous_usage_stats: the usage so far
    # vLLM's extras, always there (null unless asked for): with return_token_ids, the prompt's ids in each choice's
    # first chunk; prompt_text is return_prompt_text's, which tokenmill refuses
    prompt_token_ids: list[int] | None = None
    prompt_text: None = None


class ChatCompletionUsageChunk(msgspec.Struct):
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    id: str
    created: int
    model: str
    usage: Usage
    choices: list = msgspec.field(default_factory=list)
    object: str = "chat.completion.chunk"
