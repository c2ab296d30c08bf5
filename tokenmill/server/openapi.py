"""/openapi.json as the server really answers: every status, media type and response schema, not FastAPI's guess.

FastAPI documents the request bodies (the pydantic models, bounds included) but for responses only "200: any
JSON" and a 422 the server never sends (validation errors are 400: tokenmill/api/errors.py). Here each operation
gets the statuses it returns, with OpenAI's error object; the 200 bodies are the msgspec Structs the handlers
encode, their schemas merged into the components so that every $ref resolves; /health* are documented although
LifecycleApp answers them before FastAPI; and /v1/* carry the bearer scheme when the server has an API key.
tests/test_openapi_and_fields.py holds the server to this document with schemathesis."""
from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tokenmill.api import chat_protocol as chp, completion_protocol as cp, protocol as p
from tokenmill.api.errors import is_anthropic
from tokenmill.server import messages_protocol as msg
from tokenmill.server import models_protocol as mp
from tokenmill.server import pooling_protocol as pp
from tokenmill.server import responses_protocol as rp
from tokenmill.server import tokenization_protocol as tp
from tokenmill.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE

JSON, SSE, TEXT = "application/json", "text/event-stream", "text/plain"
RESPONSE_STRUCTS = (p.ErrorResponse, mp.ModelList, cp.CompletionResponse, cp.CompletionStreamResponse,
                    chp.ChatCompletionResponse,
                    chp.ChatCompletionChunk, chp.ChatCompletionUsageChunk, tp.TokenizeResponse, tp.DetokenizeResponse,
                    *pp.RESPONSE_STRUCTS, rp.ResponseObject, *rp.STREAM_EVENTS, msg.Message, msg.TokenCount,
                    *msg.STREAM_EVENTS)


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _events(*chunks: str) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1 describes a stream event by event): a JSON chunk, the error object a
    stream that fails after its 200 ends with, or the final [DONE]."""
    payload = {"type": "string", "contentMediaType": JSON,
               "contentSchema": {"anyOf": [_ref(name) for name in (*chunks, "ErrorResponse")]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}}}


def _named_events(*structs: type) -> dict[str, Any]:
    """One event of an Anthropic stream (/v1/messages): its type in the `event:` line, its JSON in `data:` (an
    error event last, if it fails after its 200; no [DONE])."""
    return {"type": "object", "required": ["event", "data"],
            "properties": {"event": {"enum": [s.__struct_config__.tag for s in structs]},
                           "data": {"type": "string", "contentMediaType": JSON,
                                    "contentSchema": {"anyOf": [_ref(s.__name__) for s in structs]}}}}


STRING = {"type": "string"}
VERSION = {"type": "object", "required": ["version"], "properties": {"version": STRING}}
LOAD = {"type": "object", "required": ["server_load"], "properties": {"server_load": {"type": "integer", "minimum": 0}}}
# vLLM's: tokenizer_config.json's content, which varies by tokenizer, with at least the class
TOKENIZER_INFO = {"type": "object", "required": ["tokenizer_class"], "additionalProperties": True,
                  "properties": {"tokenizer_class": STRING, "chat_template": STRING}}
ERRORS = {
    400: "Invalid request; `error.param` names the field.",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`).",
    404: "The model (or LoRA adapter) does not exist.",
    413: "The request body is larger than --max-request-body-bytes.",
    503: "Overloaded (past --max-num-queued-reqs/-tokens), loading, shutting down, or the engine is dead. Retry "
         "after Retry-After seconds, when given.",
}
# (path, method) → the media types and schemas of its 200 response. Its error statuses follow from what it takes
# (_error_statuses), so that a route added elsewhere gets them too.
OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/completions", "post"): {JSON: _ref("CompletionResponse"), SSE: _events("CompletionStreamResponse")},
    ("/v1/chat/completions", "post"): {JSON: _ref("ChatCompletionResponse"),
                                       SSE: _events("ChatCompletionChunk", "ChatCompletionUsageChunk")},
    ("/v1/responses", "post"): {JSON: _ref("ResponseObject"), SSE: _events(*(e.__name__ for e in rp.STREAM_EVENTS))},
    ("/v1/responses/{response_id}", "get"): {JSON: _ref("ResponseObject"),  # SSE: stream=true, background ones
                                             SSE: _events(*(e.__name__ for e in rp.STREAM_EVENTS))},
    ("/v1/responses/{response_id}/cancel", "post"): {JSON: _ref("ResponseObject")},
    ("/v1/responses/{response_id}", "delete"): {JSON: {
        "type": "object", "required": ["id", "object", "deleted"],
        "properties": {"id": STRING, "object": {"const": "response.deleted"}, "deleted": {"type": "boolean"}}}},
    ("/v1/messages", "post"): {JSON: _ref("Message"), SSE: _named_events(*msg.STREAM_EVENTS)},
    ("/v1/messages/count_tokens", "post"): {JSON: _ref("TokenCount")},
    ("/v1/chat/completions/batch", "post"): {JSON: _ref("ChatCompletionResponse")},
    ("/invocations", "post"): {  # whichever endpoint the body's shape selects (invocations.py)
        JSON: {"anyOf": [_ref(name) for name in ("ChatCompletionResponse", "CompletionResponse", "EmbeddingResponse",
                                                 "ScoreResponse", "RerankResponse")]},
        SSE: _events("ChatCompletionChunk", "ChatCompletionUsageChunk", "CompletionStreamResponse")},
    ("/load", "get"): {JSON: LOAD},
    ("/tokenizer_info", "get"): {JSON: TOKENIZER_INFO},
    ("/v1/models", "get"): {JSON: _ref("ModelList")},
    # with VLLM_ALLOW_RUNTIME_LORA_UPDATING (serving_models.py): vLLM's "Success: ..." line
    ("/v1/load_lora_adapter", "post"): {TEXT: STRING},
    ("/v1/unload_lora_adapter", "post"): {TEXT: STRING},
    ("/reset_prefix_cache", "post"): {},  # with VLLM_SERVER_DEV_MODE: no body, as vLLM
    ("/start_profile", "post"): {},  # with VLLM_TORCH_PROFILER_DIR: no body, as vLLM
    ("/stop_profile", "post"): {},
    ("/sleep", "post"): {},  # the same, with --enable-sleep-mode (tokenmill/server/sleep_mode.py)
    ("/wake_up", "post"): {},
    ("/is_sleeping", "get"): {JSON: {"type": "object", "properties": {"is_sleeping": {"type": "boolean"}},
                                     "required": ["is_sleeping"]}},
    ("/tokenize", "post"): {JSON: _ref("TokenizeResponse")},
    ("/detokenize", "post"): {JSON: _ref("DetokenizeResponse")},
    ("/metrics", "get"): {METRICS_CONTENT_TYPE: STRING},  # the Prometheus text exposition format
    ("/version", "get"): {JSON: VERSION},
    ("/dashboard", "get"): {"text/html": STRING},
    ("/v1/embeddings", "post"): {JSON: _ref("EmbeddingResponse")},
    ("/pooling", "post"): {JSON: _ref("PoolingResponse")},
    **{(path, "post"): {JSON: _ref("ScoreResponse")} for path in ("/score", "/v1/score")},
    **{(path, "post"): {JSON: _ref("RerankResponse")} for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
}
# Answered by LifecycleApp before FastAPI (tokenmill/api/lifecycle.py), in plain text: summary, and whether it can
# be 503
HEALTH = {
    "/health": ("Ready: 200 when a request now would be served (as vLLM's /health).", True),
    "/health/ready": ("Ready: the same as /health.", True),
    "/health/live": ("Alive: 200 while the process answers, loading included.", False),
    "/ping": ("SageMaker's health check: the same as /health, on GET and POST (as vLLM).", True),
}


def install_openapi(app: FastAPI, api_key: bool) -> None:
    """Replaces app.openapi (what /openapi.json serves); `api_key`: the server requires one on /v1/*."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, api_key)
        return app.openapi_schema

    app.openapi = openapi


# The strings pydantic's lax mode parses (tokenmill/api/protocol.py), as JSON Schema patterns (ECMA-262 and Python
# alike): an integer or a float with `_` where pydantic takes one, within the whitespace Rust's trim() strips, and
# the words for a bool (any case, no whitespace: the lookahead keeps Python's `$` from taking a final newline). The
# bounds apply to the parsed number, which a pattern cannot state. tests/test_openapi_and_fields.py holds them to
# pydantic.
_WS = "[\\t-\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]*"
_DIGITS = "[0-9]+(_[0-9]+)*"
# (a leading 0 may be followed by any run of zeros and underscores: pydantic takes "0__1" as 1)
LAX_INT = f"^{_WS}[+-]?(0[0_]*)?{_DIGITS}(\\.0+)?{_WS}$"


def _float(digits: str) -> str:
    return f"[+-]?({digits}(\\.({digits})?)?|\\.{digits})([eE][+-]?{digits})?"


# Without whitespace, pydantic takes single underscores between any two characters of a float ("0_.5", "1e_+5",
# "+_1"), none first or last: the float below with an optional `_` wherever two of its parts meet.
_UNDERSCORED = "[0-9](_?[0-9])*"
_FLOAT_UNDERSCORED = f"([+-]_?)?({_UNDERSCORED}(_?\\.(_?{_UNDERSCORED})?)?|\\._?{_UNDERSCORED})" \
    f"(_?[eE]_?([+-]_?)?{_UNDERSCORED})?"
LAX_FLOAT = f"^({_WS}{_float('[0-9]+')}{_WS}|{_FLOAT_UNDERSCORED})(?!\\n)$"
LAX_BOOL = "^([0Ff]|[Oo][Ff][Ff]|[Ff][Aa][Ll][Ss][Ee]|[Nn][Oo]?|1|[Oo][Nn]|[Tt]([Rr][Uu][Ee])?|[Yy]([Ee][Ss])?)(?!\\n)$"
_LAX = {"integer": [{"type": "boolean"}, {"type": "string", "pattern": LAX_INT}],
        "number": [{"type": "boolean"}, {"type": "string", "pattern": LAX_FLOAT}],
        "boolean": [{"enum": [0, 1]}, {"type": "string", "pattern": LAX_BOOL}]}


def _lax_types(node: Any) -> Any:
    """The request models' schemas as pydantic's lax mode validates them, so that /openapi.json says what the server
    takes: an integer or a number also as a bool or as its text, a bool also as 0, 1 or its words, a literal bool
    also as 0 or 1 (and a literal 0 or 1 as the bool)."""
    if isinstance(node, list):
        return [_lax_types(value) for value in node]
    if not isinstance(node, dict):
        return node
    node = {key: _lax_types(value) for key, value in node.items()}
    const = node.get("const")
    if isinstance(const, bool) or (type(const) is int and const in (0, 1)):
        return {"anyOf": [node, {"const": int(const) if isinstance(const, bool) else bool(const)}]}
    kind = node.get("type")
    if "const" not in node and "enum" not in node and isinstance(kind, str) and kind in _LAX:
        return {"anyOf": [node, *_LAX[kind]]}
    return node


def build_openapi(app: FastAPI, api_key: bool) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # only FastAPI's 422 uses them
        schemas.pop(name, None)
    schemas.update(_lax_types(schemas))  # the request models', before the response Structs join them
    _, structs = msgspec.json.schema_components(RESPONSE_STRUCTS, ref_template="#/components/schemas/{name}")
    clash = schemas.keys() & structs.keys()
    if clash:  # one name for a request model and a response Struct: a $ref would point at the wrong one
        raise RuntimeError(f"request and response schemas share the names {sorted(clash)}")
    schemas.update(structs)
    for path, (summary, may_fail) in HEALTH.items():
        responses = {"200": _plain("Yes.")} | ({"503": _plain("No: the phase, or why not.")} if may_fail else {})
        name = path.strip("/").replace("/", "_")
        methods = {"get": f"{name}_get", "post": f"{name}_post"} if path == "/ping" else {"get": name}
        doc["paths"][path] = {method: {"summary": summary, "operationId": op_id, "responses": responses}
                              for method, op_id in methods.items()}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if path in HEALTH:
                continue
            responses = op["responses"]
            responses.pop("422", None)
            content = OPERATIONS.get((path, method))
            if content is not None:
                responses["200"] = {"description": "OK", "content": {t: {"schema": s} for t, s in content.items()}}
            if api_key and path.startswith("/v1/"):
                op["security"] = [{"apiKey": []}]
            for status in _error_statuses(path, op, schemas, api_key):
                responses[str(status)] = _error(status, is_anthropic(path))
    if api_key:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    return doc


def _error_statuses(path: str, op: dict[str, Any], schemas: dict[str, Any], api_key: bool) -> list[int]:
    # any route: loading, draining (tokenmill/api/lifecycle.py), or overloaded or dead when it needs the engine
    statuses = {503}
    body = op.get("requestBody", {}).get("content", {}).get(JSON, {}).get("schema", {})
    if body:
        statuses |= {400, 413}
        refs = [s["$ref"] for s in (body, *body.get("anyOf", ())) if "$ref" in s]  # one shape, or any of several
        if any({"model", "lora_name"} & schemas[ref.rsplit("/", 1)[-1]].get("properties", {}).keys() for ref in refs):
            statuses.add(404)  # no such model (or LoRA adapter)
    if any(param.get("in") == "query" for param in op.get("parameters", ())):
        statuses.add(400)  # a query parameter that does not validate
    if "{" in path:
        statuses.add(404)  # no such object
    if api_key and path.startswith("/v1/"):
        statuses.add(401)
    return sorted(statuses)


def _plain(description: str) -> dict[str, Any]:
    return {"description": description, "content": {TEXT: {"schema": STRING}}}


def _error(status: int, anthropic: bool = False) -> dict[str, Any]:
    """anthropic: /v1/messages*, whose errors have Anthropic's shape."""
    schema = _ref("AnthropicErrorResponse" if anthropic else "ErrorResponse")
    response = {"description": ERRORS[status], "content": {JSON: {"schema": schema}}}
    if status == 503:
        response["headers"] = {"Retry-After": {"description": "seconds", "schema": {"type": "integer"}}}
    return response
