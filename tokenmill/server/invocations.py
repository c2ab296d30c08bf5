"""POST /invocations: SageMaker's single entry point, as vLLM serves it. The body is tried against each request
shape the server's runner serves, in vLLM's order (chat, completion; embedding, score, rerank), and the first that
validates goes to that endpoint's own handler, so that the answer (a stream included) is that endpoint's. A body
that fits none is a 400 naming the shapes it may take."""
from __future__ import annotations

import json

import pydantic
from fastapi import FastAPI, Request
from fastapi.routing import APIRoute

from tokenmill.api import chat_protocol as chp, completion_protocol as cp
from tokenmill.sampling_params import ParamError
from tokenmill.server import pooling_protocol as pp

# (request model, the path whose handler serves it), per runner
SHAPES = {
    "generate": [(chp.ChatCompletionRequest, "/v1/chat/completions"), (cp.CompletionRequest, "/v1/completions")],
    "pooling": [(pp.EmbeddingRequest, "/v1/embeddings"), (pp.ScoreRequest, "/score"), (pp.RerankRequest, "/rerank")],
}
ALL_SHAPES = [model for shapes in SHAPES.values() for model, _ in shapes]


def add_invocations_route(app: FastAPI, runner: str) -> None:
    handlers = {route.path: route.endpoint for route in app.routes if isinstance(route, APIRoute)}
    shapes = [(model, handlers[path]) for model, path in SHAPES[runner]]

    # The body is documented as any of the shapes (openapi_extra), though FastAPI does not parse it: the shape
    # is not known before trying each.
    @app.post("/invocations", openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"anyOf": [{"$ref": f"#/components/schemas/{m.__name__}"} for m in ALL_SHAPES]}}}}})
    async def invocations(raw: Request):
        try:
            body = json.loads(await raw.body())
        except ValueError as e:
            raise ParamError(f"The request body is not valid JSON: {e}") from None
        for model, handler in shapes:
            try:
                request = model.model_validate(body)
            except pydantic.ValidationError:
                continue
            return await handler(request, raw)
        names = ", ".join(model.__name__ for model, _ in shapes)
        raise ParamError(f"Cannot find suitable handler for request. Expected one of: [{names}]")
