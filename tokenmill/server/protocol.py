"""The OpenAI (and vLLM) API shapes: pydantic models for request bodies, msgspec Structs for responses.

Requests are validated by pydantic (a wrong type or a value out of its bounds becomes a 400 naming the field);
the bounds are declared on the fields, so that /openapi.json states them. Validation is strict (no "2" for 2, no 1
for true), as the schema says. Unknown request fields are accepted, ignored and logged, as vLLM does; OpenAI fields
tokenmill does not implement are refused (400), never silently ignored. Responses are built as Structs and encoded
by msgspec, which is fast enough to stream to hundreds of clients."""
from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints, model_validator

from tokenmill.sampling_params import ParamError

logger = logging.getLogger("tokenmill.server")

# What the engine's int64 tensors hold, as JSON Schema tools see it: they compute with doubles, and 2**63 - 1 is not
# one (it rounds to 2**63, out of range); 2**63 - 1024 is the largest int64 a double holds exactly.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
TOKEN_ID = "^[0-9]+$"


def _integral(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# An integer as JSON Schema counts them: 2.0 is one, "2" and true are not. (Strict validation alone refuses 2.0; lax
# validation takes "2".)
Int = Annotated[int, BeforeValidator(_integral)]

# ============================== requests ==============================


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, strict=True)


class _Body(_Request):
    """A whole request body. `_UNSUPPORTED` names the OpenAI fields tokenmill does not implement (with a hint): each
    is declared as its "off" value only, so that the schema says so, and any other value is a 400 naming it."""
    _UNSUPPORTED: ClassVar[dict[str, str]] = {}
    _UNSUPPORTED_VLLM: ClassVar[dict[str, str]] = {}  # the same for vLLM's extension fields

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, hint in (cls._UNSUPPORTED | cls._UNSUPPORTED_VLLM).items():
                value = data.get(name)
                if value not in (None, False, []) and value != cls.model_fields[name].default:  # else: "off"
                    raise ParamError(f"{name} is not supported by tokenmill{hint}, got {value!r}", name)
        return data

    @model_validator(mode="after")
    def _log_ignored(self):
        if self.model_extra:
            logger.warning("The following fields were present in the request but ignored: %s",
                           set(self.model_extra))
        return self


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage (so far) in every chunk too


class JsonSchemaFormat(_Request):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` request field: one of these."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, then vLLM's extras). The bounds that
    depend on the server (n <= --max-n, the context length, token ids in the vocabulary) are checked at run time."""
    model: str | None = None
    n: Int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # token id (as text) → bias; pydantic's schema states the keys' pattern only for the keys that match it
    logit_bias: dict[Annotated[str, StringConstraints(pattern=TOKEN_ID)], Annotated[float, Field(ge=-100, le=100)]] \
        | None = Field(default=None, json_schema_extra={"propertyNames": {"pattern": TOKEN_ID}})
    seed: Int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: Int | None = Field(default=None, ge=-1, le=INT64_MAX)  # -1 or 0: off
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool = False
    min_tokens: Int = Field(default=0, ge=0, le=INT64_MAX)
    stop_token_ids: list[Annotated[Int, Field(ge=0)]] | None = None
    priority: Int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsField | None = None
    # reasoning models: force the end of thinking after this many tokens
    thinking_token_budget: Int | None = Field(default=None, ge=0, le=INT64_MAX)
    # vLLM's response extras: the prompt's logprobs (-1: the whole vocabulary), the token ids of prompt and output,
    # and logprob tokens as "token_id:N" (None: --return-tokens-as-token-ids)
    prompt_logprobs: Int | None = Field(default=None, ge=-1)
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM: keep the last k prompt tokens (-1: up to the context), or the first k with truncation_side "right"
    truncate_prompt_tokens: Int | None = Field(default=None, ge=-1, le=INT64_MAX)
    truncation_side: Literal["left", "right"] | None = None
    # vLLM's beam search (tokenmill/beam_search.py): n is the beam width; length_penalty and early_stopping shape it
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    # vLLM's extension fields that tokenmill does not implement: declared "off", any other value is a 400
    _UNSUPPORTED_VLLM: ClassVar[dict[str, str]] = {
        name: "" for name in ("allowed_token_ids", "bad_words", "logprob_token_ids", "watermarking", "cache_salt",
                              "kv_transfer_params", "ec_transfer_params", "vllm_xargs", "repetition_detection",
                              "stream_interval", "routed_experts_prompt_start", "return_token_offsets",
                              "return_mm_kwargs", "request_id", "session_id", "logits_processors",
                              "guided_decoding_backend", "guided_whitespace_pattern")}
    allowed_token_ids: None = None
    bad_words: Annotated[list[str], Field(max_length=0)] | None = []  # [] (vLLM's default) or null
    logprob_token_ids: None = None
    watermarking: Literal[False] | None = None
    cache_salt: None = None
    kv_transfer_params: None = None
    ec_transfer_params: None = None
    vllm_xargs: None = None
    repetition_detection: None = None
    stream_interval: None = None
    routed_experts_prompt_start: Literal[0] = 0
    return_token_offsets: Literal[False] | None = None
    return_mm_kwargs: Literal[True] = True
    request_id: None = None
    session_id: None = None
    logits_processors: None = None
    guided_decoding_backend: None = None
    guided_whitespace_pattern: None = None

    @model_validator(mode="after")
    def _vllm_stream_rules(self):
        """vLLM's (and OpenAI's) checks that tie a field to `stream`."""
        if self.stream_options is not None and not self.stream:
            raise ParamError("Stream options can only be defined when `stream=True`.", "stream_options")
        if self.stream and self.prompt_logprobs is not None and self.prompt_logprobs != 0:
            raise ParamError("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        for name, off in (("length_penalty", self.length_penalty == 1.0), ("early_stopping", not self.early_stopping)):
            if not off and not self.use_beam_search:  # vLLM ignores them then; a client that sends one expects it used
                raise ParamError(f"{name} applies only to beam search (use_beam_search: true)", name)
        return self


class CompletionRequest(SamplingFields):
    _UNSUPPORTED: ClassVar[dict[str, str]] = {"suffix": ""}
    prompt: str | list[str] | list[Int] | list[list[Int]]
    # 0 only with echo (prompt scoring, as vLLM); without it SamplingParams refuses it, as vLLM's does
    max_tokens: Int | None = Field(default=16, ge=0)
    echo: bool = False
    logprobs: Int | None = Field(default=None, ge=-1)  # -1: the whole vocabulary; at most --max-logprobs
    suffix: None = None
    add_special_tokens: bool = True  # vLLM: special tokens (BOS) added to a text prompt
    _UNSUPPORTED_VLLM: ClassVar[dict[str, str]] = {**SamplingFields._UNSUPPORTED_VLLM, "prompt_embeds": ""}
    prompt_embeds: None = None
    best_of: Int | None = Field(default=None, ge=1)  # only as many as n: there is no best-of selection

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError(f"best_of is not supported by tokenmill: it must equal n ({self.n}), got {self.best_of}",
                             "best_of")
        return self


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
        "reasoning_effort": "", "return_prompt_text": "", "chat_template": ": start with --chat-template"}
    documents: None = None
    chat_template: None = None
    media_io_kwargs: None = None
    mm_processor_kwargs: None = None
    reasoning_effort: None = None
    return_prompt_text: Literal[False] | None = None
    functions: None = None
    function_call: None = None
    audio: None = None
    modalities: list[Literal["text"]] | None = Field(default=["text"], min_length=1, max_length=1)
    prediction: None = None
    web_search_options: None = None


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


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter (with VLLM_ALLOW_RUNTIME_LORA_UPDATING): both fields are required, and their
    absence is answered in vLLM's words (serving_models.py)."""
    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False  # replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter: the adapter by name (lora_int_id is accepted, as vLLM's shape has it)."""
    lora_name: str | None = None
    lora_int_id: Int | None = None


# ============================== responses ==============================


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (what a router predicts)


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "tokenmill"
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


# ---- /v1/completions ----

class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    # vLLM's extras, present only when asked for (return_token_ids, prompt_logprobs)
    token_ids: list[int] | UnsetType = UNSET
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET


class CompletionResponse(msgspec.Struct):
    """Also each streamed chunk (usage null), and the final usage chunk (no choices) when asked for."""
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


# ---- /v1/chat/completions ----

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


class ChatResponseMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # null when the answer is only tool calls or only reasoning
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChoiceEnd(msgspec.Struct, kw_only=True):
    """The fields a chat choice ends with, whole or streamed (always sent, null included)."""
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatChoice(ChoiceEnd):
    index: int
    message: ChatResponseMessage
    token_ids: list[int] | UnsetType = UNSET  # vLLM: with return_token_ids


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
    index: int
    delta: DeltaMessage
    token_ids: list[int] | UnsetType = UNSET  # vLLM: with return_token_ids, this chunk's tokens


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    # vLLM's extras, present only when asked for
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET
    prompt_token_ids: list[int] | UnsetType = UNSET


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: str = "chat.completion.chunk"
    usage: Usage | UnsetType = UNSET  # with stream_options.continuous_usage_stats: the usage so far
    prompt_token_ids: list[int] | UnsetType = UNSET  # with return_token_ids: in each choice's first chunk


class ChatCompletionUsageChunk(msgspec.Struct):
    """The last chunk when stream_options.include_usage is set: no choices, only usage."""
    id: str
    created: int
    model: str
    usage: Usage
    choices: list = msgspec.field(default_factory=list)
    object: str = "chat.completion.chunk"


# ---- /tokenize, /detokenize ----

class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob: one entry of a prompt position's {token id: logprob} map."""
    logprob: float
    rank: int | None
    decoded_token: str | None


# One map per prompt token (null for the first), keyed by token id: the prompt's own token and the top alternatives.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str
