"""Pure-ASGI middleware (streaming and disconnects pass through untouched): request ids and the API key."""
from __future__ import annotations

import hmac
import uuid

from tokenmill.server.errors import Unauthorized, exception_response
from tokenmill.server.logs import request_id_var


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
    """Requires 'Authorization: Bearer KEY' on /v1/*."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and scope["method"] != "OPTIONS":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = exception_response(
                    Unauthorized("Invalid or missing API key: send 'Authorization: Bearer <key>'."))
                return await response(scope, receive, send)
        await self.app(scope, receive, send)
