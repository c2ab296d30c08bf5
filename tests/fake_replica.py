"""Stand-ins for `tokenmill serve` replicas behind an in-process `tokenmill router`, all on the test's event loop,
for the router's orchestration tests (tests/test_router_pd.py, tests/test_router_sleep.py): each fake records
what it receives and answers in the shapes a replica does (vLLM's), so a test checks what the router sends where.
A generation is a fixed answer, one token per event, with the token ids the router asks for (return_token_ids) so
that a stream can be resumed. Faults are real: a fake stopped refuses connections, and `die_after` drops the
connection mid-stream."""
from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field

import uvicorn
from helpers import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tokenmill.tokenizer import encode

MODEL = "SmolLM2-135M-Instruct"
ANSWER = " The lighthouse keeper climbed the stairs and lit the lamp before the storm came in."


@dataclass
class Call:
    method: str
    path: str  # with its query
    body: dict | None
    headers: dict[str, str]
    at: float = field(default_factory=time.monotonic)


class FakeReplica:
    """One replica. `kv_transfer_params`: what a prefill answers with (a prefill instance), None for a plain one.
    `status`: what a generation answers (500: a broken instance). `die_after`: the stream's connection drops after
    that many token events. Sleep: vLLM's /sleep, /wake_up (taking `wake_s`), /is_sleeping; asleep, a generation
    gets 503 with Retry-After and /health/ready 503."""

    def __init__(self, tokenizer, kv_transfer_params: dict | None = None, wake_s: float = 0.0):
        self.tokenizer = tokenizer
        self.kv_transfer_params = kv_transfer_params
        self.wake_s = wake_s
        self.status = 200
        self.die_after: int | None = None
        self.asleep = False
        self.sleep_mode = True  # False: /sleep answers 404, as a replica without --enable-sleep-mode
        self.calls: list[Call] = []
        self.answer_ids = encode(tokenizer, ANSWER)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None

    def posts(self, path: str) -> list[Call]:
        return [c for c in self.calls if c.method == "POST" and c.path.split("?")[0] == path]

    # ---------------- serving ----------------

    async def start(self) -> FakeReplica:
        self.server, self._task = await serve(self.app(), self.port)
        return self

    async def stop(self) -> None:
        """Like a killed process: open connections close, new ones are refused."""
        if self.server is not None:
            self.server.should_exit = self.server.force_exit = True
            await self._task
            self.server = None

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/health/ready", self.health), Route("/health", self.health),
            Route("/v1/models", self.models), Route("/is_sleeping", self.is_sleeping),
            Route("/sleep", self.sleep, methods=["POST"]), Route("/wake_up", self.wake_up, methods=["POST"]),
            Route("/v1/chat/completions", self.generate, methods=["POST"]),
            Route("/v1/completions", self.generate, methods=["POST"])])

    async def _record(self, request: Request) -> Call:
        raw = await request.body()
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        call = Call(request.method, path, json.loads(raw) if raw else None, dict(request.headers))
        if request.url.path not in ("/health/ready", "/health", "/v1/models", "/is_sleeping"):
            self.calls.append(call)
        return call

    async def health(self, request: Request):
        return Response(status_code=503 if self.asleep else 200)

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "parent": None}]})

    async def is_sleeping(self, request: Request):
        return JSONResponse({"is_sleeping": self.asleep})

    async def sleep(self, request: Request):
        await self._record(request)
        if not self.sleep_mode:
            return JSONResponse({"detail": "Not Found"}, 404)
        self.asleep = True
        return Response(status_code=200)

    async def wake_up(self, request: Request):
        await self._record(request)
        await asyncio.sleep(self.wake_s)
        self.asleep = False
        return Response(status_code=200)

    # ---------------- generation ----------------

    async def generate(self, request: Request):
        call = await self._record(request)
        body = call.body
        if self.asleep:
            return JSONResponse({"error": {"message": "the model is sleeping", "type": "service_unavailable_error",
                                           "param": None, "code": 503}}, 503, headers={"Retry-After": "30"})
        if self.status != 200:
            return JSONResponse({"error": {"message": "broken", "type": "internal_server_error", "param": None,
                                           "code": self.status}}, self.status)
        chat = request.url.path.endswith("chat/completions")
        prompt_ids = body["prompt"] if not chat and isinstance(body.get("prompt"), list) else [1, 2, 3]
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        generated = _generated_so_far(self, prompt_ids)
        ids = self.answer_ids[generated:generated + limit]
        if not body.get("stream"):
            text = self.tokenizer.decode(ids)
            choice = {"index": 0, "finish_reason": "length"}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            answer = {"id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion", "created": 1,
                      "model": MODEL, "choices": [choice],
                      "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                                "total_tokens": len(prompt_ids) + len(ids)}}
            if self.kv_transfer_params is not None and (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
                answer["kv_transfer_params"] = self.kv_transfer_params
            return JSONResponse(answer)
        return StreamingResponse(self._stream(chat, body, prompt_ids, ids), media_type="text/event-stream")

    async def _stream(self, chat: bool, body: dict, prompt_ids: list[int], ids: list[int]):
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": "chatcmpl-fake" if chat else "cmpl-fake", "object": obj, "created": 1, "model": MODEL}
        previous = self.tokenizer.decode(self.answer_ids[:_generated_so_far(self, prompt_ids)])
        done = self.answer_ids[:_generated_so_far(self, prompt_ids)]
        for i, token in enumerate(ids):
            if self.die_after is not None and i == self.die_after:
                raise ConnectionResetError("the fake replica dies mid-stream")  # uvicorn drops the connection
            done = done + [token]
            text = self.tokenizer.decode(done)
            piece, previous = text[len(previous):], text
            finish = "length" if i == len(ids) - 1 else None
            if chat:
                choice = {"index": 0, "delta": {"content": piece}, "finish_reason": finish, "token_ids": [token]}
                chunk = {**base, "choices": [choice]}
                if i == 0:
                    chunk["prompt_token_ids"] = prompt_ids
            else:
                choice = {"index": 0, "text": piece, "finish_reason": finish, "token_ids": [token]}
                if i == 0:
                    choice["prompt_token_ids"] = prompt_ids
                chunk = {**base, "choices": [choice]}
            yield f"data: {json.dumps(chunk)}\n\n"
            await asyncio.sleep(0.005)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                 "total_tokens": len(prompt_ids) + len(ids)}
        yield f"data: {json.dumps({**base, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"


def _generated_so_far(replica: FakeReplica, prompt_ids: list[int]) -> int:
    """A resumed request's prompt is the original prompt ([1, 2, 3] for chat) followed by the answer so far."""
    tail = prompt_ids[3:]
    return len(tail) if tail == replica.answer_ids[:len(tail)] and prompt_ids[:3] == [1, 2, 3] else 0


async def serve(app, port: int) -> tuple[uvicorn.Server, asyncio.Task]:
    """`app` served on 127.0.0.1:port by uvicorn, on this event loop, once it listens."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical",
                                           timeout_graceful_shutdown=1))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
            raise RuntimeError(f"nothing listens on port {port}")
        await asyncio.sleep(0.01)
    return server, task


@contextlib.asynccontextmanager
async def running_router(config, tokenizer):
    """An in-process `tokenmill router` (its app, lifespan and all) with `config`: (its URL, its state)."""
    from tokenmill.router.app import build_app, build_state
    state = build_state(config, tokenizer)
    port = free_port()
    server, task = await serve(build_app(state), port)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = server.force_exit = True
        await task
