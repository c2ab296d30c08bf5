"""/v1/embeddings and /pooling, and what every pooling endpoint shares: inputs to token ids (truncated when
asked), the checks, and one engine request per input, each finished by its one pooled output.

Every input is checked before any is sent, so a bad one fails the request with nothing left running; a client
that goes away aborts the inputs still in the engine."""
from __future__ import annotations

import array
import asyncio
import base64
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tokenmill.engine.messages import RequestError
from tokenmill.pooling_params import PoolingParams, truncate, validate_pooling_request
from tokenmill.sampling_params import ParamError, SamplingParams
from tokenmill.server import pooling_protocol as pp
from tokenmill.server.responses import ClientDisconnected, json_response, until_disconnected
from tokenmill.server.server_state import ServerState

_NO_SAMPLING = SamplingParams(max_tokens=1)  # AddRequest carries one; a pooling request never reads it


class PoolingServing:
    def __init__(self, state: ServerState):
        self.state = state

    def check(self, model: str | None) -> None:
        """Before anything else: the model name, and that this server pools at all."""
        self.state.check_model(model, runner="pooling")

    async def token_ids(self, inputs, truncate_prompt_tokens: int | None) -> list[list[int]]:
        """A string, strings, token ids or token-id lists → one token-id list per input."""
        state = self.state
        if isinstance(inputs, str):
            inputs = [inputs]
        if not inputs:
            raise ParamError("input must not be empty", "input")
        if isinstance(inputs[0], int):
            inputs = [inputs]
        if isinstance(inputs[0], str):
            if truncate_prompt_tokens is None:
                prompts = await state.encode(inputs)
            else:
                prompts = await asyncio.to_thread(lambda: [state.tokenizer.encode(t) for t in inputs])
        else:
            prompts = [list(ids) for ids in inputs]
        return [truncate(ids, truncate_prompt_tokens, state.engine.max_model_len) for ids in prompts]

    async def pool(self, raw: Request, prompts: list[list[int]], params: PoolingParams,
                   priority: int) -> list[list[float]] | Response:
        """The pooled vector of each prompt (or a 499 response when the client went away)."""
        state, e = self.state, self.state.engine
        state.client.check_alive()
        if e.scheduling_policy == "fcfs" and priority != 0:
            raise ParamError("priority is only allowed with --scheduling-policy priority", "priority")
        for ids in prompts:
            validate_pooling_request(ids, params, e.max_model_len, e.vocab_size, e.matryoshka, e.runner)
        state.check_queue(prompts)
        base = f"pool-{uuid.uuid4().hex}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        queues = [asyncio.Queue() for _ in prompts]
        finished: set[int] = set()
        for rid, prompt, queue in zip(ids, prompts, queues):
            state.client.add_request(rid, prompt, _NO_SAMPLING, None, priority, queue, pooling=params)
        try:
            return await until_disconnected(raw.receive, _collect(queues, finished))
        except ClientDisconnected:
            return Response(status_code=499)
        finally:
            # anything not finished (an error, a disconnect): stop it in the engine
            state.client.abort([rid for i, rid in enumerate(ids) if i not in finished])

    def usage(self, prompts: list[list[int]]) -> pp.PoolingUsage:
        n = sum(len(ids) for ids in prompts)
        return pp.PoolingUsage(n, n)

    async def embeddings(self, req: pp.EmbeddingRequest, raw: Request):
        return await self._respond(req, raw, "embedding")

    async def pooling(self, req: pp.EmbeddingRequest, raw: Request):
        """vLLM's /pooling: the embeddings request and answer, the vectors under `data`."""
        return await self._respond(req, raw, "pooling")

    async def _respond(self, req: pp.EmbeddingRequest, raw: Request, kind: str):
        state = self.state
        self.check(req.model)
        prompts = await self.token_ids(req.input, req.truncate_prompt_tokens)
        vectors = await self.pool(raw, prompts, PoolingParams(req.dimensions), req.priority)
        if isinstance(vectors, Response):
            return vectors
        if req.encoding_format == "base64":
            vectors = [base64.b64encode(array.array("f", v).tobytes()).decode() for v in vectors]
        model, created, usage = state.model_names[0], int(time.time()), self.usage(prompts)
        if kind == "pooling":
            data = [pp.PoolingData(i, v) for i, v in enumerate(vectors)]
            return json_response(pp.PoolingResponse(f"pool-{uuid.uuid4().hex}", created, model, data, usage))
        data = [pp.EmbeddingData(i, v) for i, v in enumerate(vectors)]
        return json_response(pp.EmbeddingResponse(f"embd-{uuid.uuid4().hex}", created, model, data, usage))


async def _collect(queues: list[asyncio.Queue], finished: set[int]) -> list[list[float]]:
    out = []
    for i, queue in enumerate(queues):
        item = await queue.get()
        if isinstance(item, RequestError):
            raise ParamError(item.message, item.param)
        if isinstance(item, BaseException):  # the engine died
            raise item
        if item.pooled is None:
            raise ParamError(f"the request ended ({item.finish_reason}) without an embedding", "input")
        finished.add(i)
        out.append(item.pooled)
    return out


def add_embedding_routes(app: FastAPI, state: ServerState) -> None:
    serving = PoolingServing(state)
    app.add_api_route("/v1/embeddings", serving.embeddings, methods=["POST"], operation_id="create_embedding")
    app.add_api_route("/pooling", serving.pooling, methods=["POST"], operation_id="create_pooling")
