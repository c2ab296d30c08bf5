"""The OpenAI (and vLLM) API shapes: pydantic models for request bodies, msgspec Structs for responses. This module
holds what every endpoint family shares (the request base classes, the sampling fields of completions and chat,
errors, usage); each family's own shapes are in its module (completion_protocol.py, chat_protocol.py here;
pooling, responses, tokenization and models in tokenmill/server/).

Requests are validated by pydantic (a wrong type or a value out of its bounds becomes a 400 naming the field);
the bounds are declared on the fields, so that /openapi.json states them. Validation is pydantic's lax mode, as
vLLM's: "2" is taken for 2 and "true" (or 1) for true, and /openapi.json states those string forms
(tokenmill/server/openapi.py). Unknown request fields are accepted, ignored and logged, as vLLM does; OpenAI fields
tokenmill does not implement are refused (400), never silently ignored. Responses are built as Structs and encoded
by msgspec, which is fast enough to stream to hundreds of clients."""
from __future__ import annotations

import logging
from typing import Annotated, Any, ClassVar, Literal

import msgspec
from msgspec import UNSET, UnsetType
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

from tokenmill.sampling_params import ParamError

logger = logging.getLogger("tokenmill.server")

# What the engine's int64 tensors hold, as JSON Schema tools see it: they compute with doubles, and 2**63 - 1 is not
# one (it rounds to 2**63, out of range); 2**63 - 1024 is the largest int64 a double holds exactly.
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
# vLLM's reasoning_effort values (chat's reasoning_effort, the Responses API's reasoning.effort): passed to the chat
# template as its `reasoning_effort` variable, as vLLM does; a template that does not read it ignores it
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
TOKEN_ID = "^[0-9]+$"


# An integer: lax validation takes 2.0 (an integer to JSON Schema too) and "2", and refuses 2.5.
Int = int

# ============================== requests ==============================


class _Request(BaseModel):
    """Lax, as vLLM's request models: a client that sends "logprobs": "true" or "n": "2" is served as vLLM serves it."""
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


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


class LegacyStructuralTag(_Request):
    """One of a structural_tag's `structures` (vLLM's legacy form): after `begin`, JSON of `schema`, then `end`."""
    begin: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    end: str


class ResponseFormat(_Request):
    """OpenAI's types, and vLLM's structural_tag in either of its forms: xgrammar's structural tag as `format`, or
    the legacy `structures` with the `triggers` that open them (free text elsewhere)."""
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[LegacyStructuralTag] | None = None
    triggers: list[str] | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` request field: one of these (structural_tag: as JSON text)."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | None = None


class KVTransferParamsField(BaseModel):
    """vLLM's `kv_transfer_params` (its NixlConnector's keys): `{"do_remote_decode": true}` to a prefill instance,
    or the prefill instance's answer, as it was, to a decode instance (tokenmill/kv_transfer_params.py). Closed: a
    key this server does not read is a 400, never ignored."""
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[Annotated[Int, Field(ge=0, le=INT64_MAX)]] | None = None
    remote_host: str | None = None
    remote_port: Int | None = Field(default=None, ge=1, le=65535)
    remote_request_id: str | None = None
    tp_size: Literal[1] = 1


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
        name: "" for name in ("logprob_token_ids", "watermarking",
                              "ec_transfer_params", "vllm_xargs", "repetition_detection",
                              "routed_experts_prompt_start", "return_token_offsets",
                              "return_mm_kwargs", "request_id", "session_id", "logits_processors",
                              "guided_decoding_backend", "guided_whitespace_pattern")}
    allowed_token_ids: Annotated[list[Int], Field(min_length=1)] | None = None  # vLLM's: sample among these only
    bad_words: list[str] | None = []  # vLLM's: words never generated (sampling_params.bad_words_token_ids)
    logprob_token_ids: None = None
    watermarking: Literal[False] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: only the same salt shares cached KV
    # disaggregated prefill/decode with --kv-transfer-config TCPConnector (tokenmill/engine/kv_transfer.py)
    kv_transfer_params: KVTransferParamsField | None = None
    ec_transfer_params: None = None
    vllm_xargs: None = None
    repetition_detection: None = None
    stream_interval: Int | None = Field(default=None, ge=1, le=INT64_MAX)  # tokens per chunk (--stream-interval)
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


# ============================== responses ==============================


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class AnthropicError(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorResponse(msgspec.Struct, tag_field="type", tag="error"):
    """The error body of /v1/messages* (Anthropic's shape, which its SDK reads, as vLLM's endpoint answers);
    the message starts with the field it is about, as Anthropic's do."""
    error: AnthropicError


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (what a router predicts)


class Usage(msgspec.Struct):
    """prompt_tokens_details as vLLM sends it: null in a whole response, absent from a stream's chunks."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None | UnsetType = UNSET


class PromptLogprob(msgspec.Struct):
    """vLLM's Logprob: one entry of a prompt position's {token id: logprob} map."""
    logprob: float
    rank: int | None
    decoded_token: str | None


# One map per prompt token (null for the first), keyed by token id: the prompt's own token and the top alternatives.
PromptLogprobs = list[dict[int, PromptLogprob] | None]
