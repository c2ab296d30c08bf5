"""Errors in OpenAI's JSON shape: one table from exception to (status, type), for responses and stream events.

A request that fails before its status line goes out gets a JSON error response; one that fails while streaming
gets the same error object as its last SSE event. Both come from ERRORS, so a failure reads the same either way.
Types follow OpenAI's snake_case names."""
from __future__ import annotations

import logging
from typing import NamedTuple

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from tokenmill.api import chat_protocol as chp, completion_protocol as cp, protocol as p
from tokenmill.sampling_params import ParamError

logger = logging.getLogger("tokenmill.server")

RETRY_AFTER_S = 5  # the Retry-After of every 503: queue full, loading, draining, asleep


class EngineDeadError(RuntimeError):
    """The engine process has exited; nothing can be served."""


class StreamStalled(RuntimeError):
    """The client stopped reading its stream; the request was aborted."""


class RequestAborted(RuntimeError):
    """The server ended a request it had accepted (POST /sleep in its abort mode): 503, or a stream's error event."""


class ModelNotFound(Exception):
    param = "model"

    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.")


class LoRANotFound(Exception):
    """An adapter name or path the server does not know (vLLM answers these 404 too)."""
    param = "lora_name"


class Unauthorized(Exception):
    """No API key, or the wrong one."""


class Overloaded(Exception):
    """The queue is past --max-num-queued-reqs or --max-num-queued-tokens: 503 with Retry-After."""


class RequestTooLarge(Exception):
    """The body is past --max-request-body-bytes: refused before it is read in full."""


class ServiceUnavailable(Exception):
    """The server is loading its model, shutting down or asleep: 503 with Retry-After."""


class ErrorKind(NamedTuple):
    status: int
    type: str
    message: str = "{}"  # the exception's text goes in {}
    retry_after: bool = False


ERRORS: dict[type[BaseException], ErrorKind] = {
    ParamError: ErrorKind(400, "invalid_request_error"),
    Unauthorized: ErrorKind(401, "authentication_error"),
    ModelNotFound: ErrorKind(404, "not_found_error"),
    LoRANotFound: ErrorKind(404, "not_found_error"),
    RequestTooLarge: ErrorKind(413, "invalid_request_error"),
    Overloaded: ErrorKind(503, "overloaded_error", retry_after=True),
    ServiceUnavailable: ErrorKind(503, "service_unavailable_error", "Service unavailable: {}.", retry_after=True),
    EngineDeadError: ErrorKind(503, "service_unavailable_error", "The server cannot serve requests: {}"),
    StreamStalled: ErrorKind(408, "timeout_error", "The request was aborted: {}."),
    RequestAborted: ErrorKind(503, "service_unavailable_error", "The request was aborted: {}.", retry_after=True),
}
INTERNAL_ERROR = ErrorKind(500, "internal_server_error", "Internal server error; see the server log.")
# Starlette's own HTTP errors (unknown route, wrong method) by status; any other status is invalid_request_error
HTTP_ERROR_TYPES = {401: "authentication_error", 404: "not_found_error", 503: "service_unavailable_error"}


def error_kind(exc: BaseException) -> ErrorKind:
    for cls in type(exc).__mro__:
        if cls in ERRORS:
            return ERRORS[cls]
    return INTERNAL_ERROR


def error_info(exc: BaseException) -> p.ErrorInfo:
    kind = error_kind(exc)
    return p.ErrorInfo(kind.message.format(exc), kind.type, getattr(exc, "param", None), kind.status)


# Anthropic's Messages API (/v1/messages*) answers errors in its own shape, with its own names for three types
ANTHROPIC_PATHS = "/v1/messages"
ANTHROPIC_TYPES = {"service_unavailable_error": "overloaded_error", "internal_server_error": "api_error",
                   "timeout_error": "api_error"}


def anthropic_error(info: p.ErrorInfo) -> p.AnthropicErrorResponse:
    """The field goes in front of the message (Anthropic's has no `param`): "max_tokens: field required"."""
    message = info.message
    if info.param and not message.startswith(info.param):
        message = f"{info.param}: {message}"
    return p.AnthropicErrorResponse(p.AnthropicError(ANTHROPIC_TYPES.get(info.type, info.type), message))


def error_response(status: int, message: str, type_: str, param: str | None = None,
                   anthropic: bool = False) -> Response:
    info = p.ErrorInfo(message, type_, param, status)
    body = anthropic_error(info) if anthropic else p.ErrorResponse(info)
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def exception_response(exc: BaseException, anthropic: bool = False) -> Response:
    """anthropic: in the shape of /v1/messages* (is_anthropic)."""
    info = error_info(exc)
    response = error_response(info.code, info.message, info.type, info.param, anthropic)
    if error_kind(exc).retry_after:
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def is_anthropic(path: str) -> bool:
    return path.startswith(ANTHROPIC_PATHS)


def http_error_response(exc: StarletteHTTPException, anthropic: bool = False) -> Response:
    """Starlette's own HTTP errors (an unknown route, a wrong method) in the one error shape."""
    type_ = HTTP_ERROR_TYPES.get(exc.status_code, "invalid_request_error")
    response = error_response(exc.status_code, str(exc.detail), type_, anthropic=anthropic)
    response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110)
    return response


def stream_error_info(exc: BaseException, request_id: str) -> p.ErrorInfo:
    """What a stream that failed after its 200 status line went out reports; an internal error is logged."""
    if error_kind(exc) is INTERNAL_ERROR:
        logger.error("internal error while streaming %s", request_id, exc_info=exc)
    return error_info(exc)


def sse_error_event(exc: BaseException, request_id: str) -> bytes:
    """The last event of a stream that failed after its 200 status line went out."""
    return b"data: " + msgspec.json.encode(p.ErrorResponse(stream_error_info(exc, request_id))) + b"\n\n"


def anthropic_error_event(exc: BaseException, request_id: str) -> bytes:
    """sse_error_event for a /v1/messages stream: Anthropic's `error` event."""
    info = stream_error_info(exc, request_id)
    return b"event: error\ndata: " + msgspec.json.encode(anthropic_error(info)) + b"\n\n"


_BOUND_ERRORS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")


def _out_of_bounds(where: str, top_level: bool, error: dict) -> str:
    """A value out of the bounds its field declares, in the words SamplingParams.validate uses ("top_p must be in
    (0, 1]", "n must be at least 1", "non-negative", "must fit in 64 bits"), which clients and tests know. pydantic
    names only the bound that failed; a top-level field's other bound comes from its declaration."""
    violated = error.get("ctx", {})
    bounds = dict(violated)
    if top_level:
        for model in (cp.CompletionRequest, chp.ChatCompletionRequest):
            field = model.model_fields.get(where)
            if field is not None:
                declared = {k: getattr(m, k) for m in field.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)}
                bounds = {**declared, **violated}  # the models may bound a shared name differently (max_tokens)
                break
    value = error.get("input")
    if any(v in (p.INT64_MIN, p.INT64_MAX) for v in violated.values()):
        return f"{where} must fit in 64 bits, got {value}"
    low = [(k, v) for k, v in bounds.items() if k in ("ge", "gt") and v != p.INT64_MIN]
    high = [(k, v) for k, v in bounds.items() if k in ("le", "lt") and v != p.INT64_MAX]
    if low and high:
        (lk, lv), (hk, hv) = low[0], high[0]
        interval = f"{'[' if lk == 'ge' else '('}{lv:g}, {hv:g}{']' if hk == 'le' else ')'}"
        return f"{where} must be in {interval}, got {value}"
    k, v = (low or high)[0]
    words = {"ge": "non-negative" if v == 0 else f"at least {v:g}", "gt": "positive" if v == 0 else f"more than {v:g}",
             "le": f"at most {v:g}", "lt": f"less than {v:g}"}
    return f"{where} must be {words[k]}, got {value}"


def _validation_error(exc: RequestValidationError) -> Exception:
    """pydantic's 422 becomes a 400 (a ParamError), naming the first offending field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return ParamError(f"The request body is not valid JSON: {ctx}".rstrip(": "))
    if first.get("type") == "value_error" and isinstance(first.get("ctx", {}).get("error"), ParamError):
        return first["ctx"]["error"]  # a model validator's own error, param and all
    where = ".".join(str(x) for x in loc) or "body"
    if first.get("type") == "missing":
        message = f"{where}: field required"
    elif first.get("type") in _BOUND_ERRORS:
        message = _out_of_bounds(where, len(loc) == 1, first)
    else:
        message = f"{where}: {first.get('msg')} (got {first.get('input')!r})"
    return ParamError(message, str(loc[0]) if loc else None)


def add_error_handlers(app: FastAPI) -> None:
    async def on_error(request: Request, exc: Exception) -> Response:
        return exception_response(exc, is_anthropic(request.url.path))

    for cls in ERRORS:
        app.add_exception_handler(cls, on_error)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return exception_response(_validation_error(exc), is_anthropic(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 405:  # Starlette names the first route of the path's; Allow lists every route's
            methods = {m for route in request.app.routes if route.matches(request.scope)[0] is not Match.NONE
                       for m in getattr(route, "methods", None) or ()}
            exc = StarletteHTTPException(405, exc.detail, {"Allow": ", ".join(sorted(methods))})
        return http_error_response(exc, is_anthropic(request.url.path))

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return exception_response(exc, is_anthropic(request.url.path))
