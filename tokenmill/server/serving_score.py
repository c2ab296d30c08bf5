"""/v1/score and /v1/rerank for bi-encoders (vLLM's shapes; rerank's is Jina's and Cohere's): every text is embedded
once, through the same pooling requests as /v1/embeddings, and a pair scores the cosine similarity of its two
embeddings, as vLLM and sentence-transformers score them."""
from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.pooling_outputs import cosine_similarity
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import ParamError
from tokenmill.server import pooling_protocol as pp
from tokenmill.server.responses import json_response
from tokenmill.server.server_state import ServerState
from tokenmill.server.serving_embedding import PoolingServing


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[int, int]]:
    """vLLM's pairing, as indices into text_1 and text_2: one against each of many, or pairwise."""
    t1 = [text_1] if isinstance(text_1, str) else text_1
    t2 = [text_2] if isinstance(text_2, str) else text_2
    if not t1 or not t2:
        raise ParamError("text_1 and text_2 must not be empty", "text_1" if not t1 else "text_2")
    if len(t1) == 1:
        return [(0, j) for j in range(len(t2))]
    if len(t1) != len(t2):
        raise ParamError(f"text_1 and text_2 must have the same length (or text_1 one text), got {len(t1)} and "
                         f"{len(t2)}", "text_2")
    return [(i, i) for i in range(len(t1))]


class ScoreServing(PoolingServing):
    async def _scores(self, req, raw: Request, texts_1: list[str], texts_2: list[str],
                      pairs: list[tuple[int, int]]) -> tuple[list[float], list[list[int]]] | Response:
        """The cosine score of each pair, and the token ids of every text (for usage)."""
        self.check(req.model)
        prompts = await self.token_ids(texts_1 + texts_2, req.truncate_prompt_tokens)
        vectors = await self.pool(raw, prompts, PoolingParams(), req.priority)
        if isinstance(vectors, Response):
            return vectors
        n1 = len(texts_1)
        return [cosine_similarity(vectors[i], vectors[n1 + j]) for i, j in pairs], prompts

    async def score(self, req: pp.ScoreRequest, raw: Request):
        self.check(req.model)
        pairs = score_pairs(req.text_1, req.text_2)
        t1 = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        t2 = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        result = await self._scores(req, raw, t1, t2, pairs)
        if isinstance(result, Response):
            return result
        scores, prompts = result
        data = [pp.ScoreData(i, s) for i, s in enumerate(scores)]
        return json_response(pp.ScoreResponse(f"score-{uuid.uuid4().hex}", int(time.time()),
                                              self.state.model_names[0], data, self.usage(prompts)))

    async def rerank(self, req: pp.RerankRequest, raw: Request):
        self.check(req.model)
        if not req.documents:
            raise ParamError("documents must not be empty", "documents")
        result = await self._scores(req, raw, [req.query], req.documents, [(0, j) for j in range(len(req.documents))])
        if isinstance(result, Response):
            return result
        scores, prompts = result
        order = sorted(range(len(scores)), key=lambda j: -scores[j])
        if req.top_n:
            order = order[:req.top_n]
        results = [pp.RerankResult(j, scores[j], pp.RerankDocument(req.documents[j]) if req.return_documents else None)
                   for j in order]
        usage = pp.RerankUsage(sum(len(ids) for ids in prompts))
        return json_response(pp.RerankResponse(f"rerank-{uuid.uuid4().hex}", self.state.model_names[0], usage,
                                               results))


def add_score_routes(app: FastAPI, state: ServerState) -> None:
    serving = ScoreServing(state)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, serving.score, methods=["POST"], operation_id=f"score{path.replace('/', '_')}")
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, serving.rerank, methods=["POST"], operation_id=f"rerank{path.replace('/', '_')}")
