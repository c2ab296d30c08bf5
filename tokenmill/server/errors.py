"""OpenAI-shaped error responses, and the errors the server maps to them."""
from __future__ import annotations

import msgspec
from fastapi.responses import Response

from tokenmill.server import protocol as p


def error_response(status: int, message: str, type_: str, param: str | None = None) -> Response:
    body = p.ErrorResponse(p.ErrorInfo(message, type_, param, status))
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


class Overloaded(Exception):
    """The queue is past --max-num-queued-reqs or --max-num-queued-tokens: 503 with Retry-After."""
