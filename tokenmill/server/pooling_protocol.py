"""The request and response shapes of the pooling endpoints, as vLLM and OpenAI define them: /v1/embeddings and
/pooling (OpenAI's embeddings shape), /v1/score (vLLM's), /v1/rerank (vLLM's, which is Jina's and Cohere's).

The conventions are tokenmill/api/protocol.py's: pydantic request bodies with lax validation and the bounds on
the fields, msgspec Structs for the responses."""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from pydantic import Field, model_validator

from tokenmill.api.protocol import INT64_MAX, INT64_MIN, Int, _Body
from tokenmill.sampling_params import ParamError


def _bounded(ge: int, le: int = INT64_MAX):
    """An integer in [ge, le]."""
    return Annotated[int, Field(ge=ge, le=le)]


TokenId = _bounded(0)


# ============================== requests ==============================

class _PoolingFields(_Body):
    model: str | None = None
    user: str | None = None
    # vLLM's: keep the last k tokens of each input (-1: max_model_len); unset, a longer input is a 400
    truncate_prompt_tokens: _bounded(-1) | None = None
    priority: Int = Field(default=0, ge=INT64_MIN, le=INT64_MAX)


class EmbeddingRequest(_PoolingFields):
    """OpenAI's: a string, a list of strings, token ids, or a list of token-id lists."""
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: _bounded(1) | None = None  # only for Matryoshka models: checked at run time

    @model_validator(mode="after")
    def _not_empty(self):
        if not self.input or (isinstance(self.input, list) and any(isinstance(i, list) and not i for i in self.input)):
            raise ParamError("input must not be empty", "input")
        return self


class ScoreRequest(_PoolingFields):
    """vLLM's /score: text_1 against text_2 (one against each of many, or pairwise when both are lists)."""
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_PoolingFields):
    """vLLM's /rerank (Jina's and Cohere's): the documents ordered by relevance to the query."""
    query: str
    documents: list[str]
    top_n: Int = Field(default=0, ge=0, le=INT64_MAX)  # 0: all
    return_documents: bool = True


# ============================== responses ==============================

class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # base64 of little-endian float32s, when encoding_format is base64
    object: str = "embedding"


class EmbeddingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage
    object: str = "list"


class PoolingData(msgspec.Struct):
    index: int
    data: list[float] | str
    object: str = "pooling"


class PoolingResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage
    object: str = "list"


class ScoreData(msgspec.Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"


class RerankDocument(msgspec.Struct):
    text: str


class RerankResult(msgspec.Struct, omit_defaults=True):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(msgspec.Struct):
    total_tokens: int


class RerankResponse(msgspec.Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


RESPONSE_STRUCTS = (EmbeddingResponse, PoolingResponse, ScoreResponse, RerankResponse)
