"""/v1/completions: the request body and the response (each streamed chunk has the response's shape)."""
from __future__ import annotations

from typing import ClassVar

import msgspec
from msgspec import UNSET, UnsetType
from pydantic import Field, model_validator

from tokenmill.api.protocol import Int, PromptLogprobs, SamplingFields, Usage
from tokenmill.kv_transfer_params import KVTransferParams
from tokenmill.sampling_params import ParamError


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


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int] = msgspec.field(default_factory=list)
    token_logprobs: list[float | None] = msgspec.field(default_factory=list)
    tokens: list[str] = msgspec.field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = msgspec.field(default_factory=list)


class CompletionChoice(msgspec.Struct):
    """A whole response's choice: vLLM's extras always present, null when not asked for."""
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct):
    """The whole response: every field vLLM sends, null included."""
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"
    service_tier: None = None
    system_fingerprint: None = None
    kv_transfer_params: KVTransferParams | None = None  # a prefill instance's: where a decode instance fetches


class CompletionStreamChoice(msgspec.Struct):
    """A streamed chunk's choice, vLLM's fields always there: the ids null unless asked for (return_token_ids; the
    prompt's in the choice's first chunk)."""
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionStreamResponse(msgspec.Struct):
    """Each streamed chunk (usage null), and the final usage chunk (no choices) when asked for."""
    id: str
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None
    object: str = "text_completion"
