"""What the offline pooling API returns (vLLM's EmbeddingRequestOutput and ScoringRequestOutput shapes), and how a
bi-encoder scores a pair: the cosine similarity of the two embeddings, as vLLM and sentence-transformers do.
Imports no torch: the API server scores with it too."""
from __future__ import annotations

import math
from dataclasses import dataclass


def cosine_similarity(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    prompt_token_ids: list[int]  # the query's, then the document's
    outputs: ScoringOutput
    finished: bool = True
