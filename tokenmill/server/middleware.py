"""Pure-ASGI middleware (streaming and disconnects pass through untouched): request ids, the API key, and the
request-body size limit."""
from __future__ import annotations

import hmac
import time
import uuid

from tokenmill.api.errors import RequestTooLarge, Unauthorized, exception_response, is_anthropic
from tokenmill.logs import request_id_var


class RequestIdMiddleware:
    """Echoes the client's X-Request-Id, or makes one up."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        if request_id is None:
            request_id = uuid.uuid4().hex.encode()
            scope["headers"] = [*scope["headers"], (b"x-request-id", request_id)]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        token = request_id_var.set(request_id.decode(errors="replace"))
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


class ApiKeyMiddleware:
    """Requires 'Authorization: Bearer KEY' on /v1/*; on /v1/messages*, 'x-api-key: KEY' (the anthropic SDK's
    header) will do too."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            headers = dict(scope["headers"])
            anthropic = is_anthropic(scope["path"])
            if not (hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
                    or (anthropic and hmac.compare_digest(headers.get(b"x-api-key", b""), self.key))):
                how = "'x-api-key: <key>' or " if anthropic else ""
                response = exception_response(
                    Unauthorized(f"Invalid or missing API key: send {how}'Authorization: Bearer <key>'."), anthropic)
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodySizeLimitMiddleware:
    """Refuses bodies over `limit` bytes with 413, deciding from Content-Length before reading any of it, or, for
    a chunked body, as soon as the count passes the limit; nothing past the limit is kept in memory.

    The rest of a refused body is read and dropped (for up to DRAIN_S) before the 413 goes out: a server that
    answers and closes while the client is still sending makes the client see a reset instead of the answer."""
    DRAIN_S = 2.0

    def __init__(self, app, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(int(length), receive, scope, send, 0)
        if length is not None:  # within the limit; the HTTP server holds the client to it
            return await self.app(scope, receive, send)
        chunks, size = [], 0  # a chunked body: read it here, counting
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._refuse(None, receive, scope, send, size, message.get("more_body", False))
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: disconnects

        await self.app(scope, replay, send)

    async def _refuse(self, length: int | None, receive, scope, send, read: int, more: bool = True) -> None:
        deadline = time.monotonic() + self.DRAIN_S
        while more and time.monotonic() < deadline:
            message = await receive()
            more = message["type"] == "http.request" and message.get("more_body", False)
            read += len(message.get("body", b""))
        if length is None and not more:  # a chunked body drained to its end: now its size is known
            length = read
        size = f"{length} bytes" if length is not None else f"over {read} bytes"
        error = RequestTooLarge(f"The request body is {size}, more than the server accepts "
                                f"(--max-request-body-bytes {self.limit}).")
        await exception_response(error)(scope, receive, send)


class ServerLoadMiddleware:
    """vLLM's --enable-server-load-tracking: the requests to the generation and pooling routes (`paths`) in flight,
    from arrival until their response, a stream included, has gone out. GET /load reads the count."""

    def __init__(self, app, state, paths: frozenset[str]):
        self.app, self.state, self.paths = app, state, paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            return await self.app(scope, receive, send)
        self.state.server_load += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.server_load -= 1
