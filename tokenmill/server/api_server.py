"""`tokenmill serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

This process tokenizes, applies chat templates, detokenizes and matches stop strings; the engine core runs in its
own process (tokenmill/engine/core_proc.py), reached through EngineClient. The model is loaded before the port
opens, so /health answers only once the server can serve."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hmac
import json
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import tokenmill
from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.engine.core_proc import EngineReady
from tokenmill.engine.engine import validate_request
from tokenmill.models.loader import load_tokenizer, resolve_model_path
from tokenmill.reasoning import ReasoningSpec, ReasoningSplitter
from tokenmill.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from tokenmill.server import protocol as p
from tokenmill.server.chat_output import ChatOutputParser
from tokenmill.server.chat_utils import SHIPPED_TEMPLATES, load_chat_template, render_chat
from tokenmill.server.engine_client import EngineClient, EngineDeadError, GenerationStream
from tokenmill.server.errors import Overloaded, error_response
from tokenmill.server.lifecycle import RETRY_AFTER_S, DrainingServer, Lifecycle, LifecycleApp
from tokenmill.server.logs import configure_logging, request_id_var
from tokenmill.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.tool_parsers import TOOL_PARSERS, named_tool_schema, required_tools_schema, validate_tools
from tokenmill.server.tracing import RequestTrace, make_tracer

logger = logging.getLogger("tokenmill.server")

DEFAULT_MAX_N = 128  # OpenAI's own limit for n
# One self-contained page (no CDN): live charts computed in the browser from /metrics.
DASHBOARD_HTML = (Path(__file__).parent / "dashboard.html").read_bytes()


# ============================== CLI ==============================

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    EngineConfig.add_cli_args(parser)
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="the model name(s) the API accepts; the first is reported (default: the model)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on /v1/* (default: $TOKENMILL_API_KEY)")
    parser.add_argument("--allowed-origins", type=json.loads, default=["*"], help="CORS origins, a JSON list")
    parser.add_argument("--allowed-methods", type=json.loads, default=["*"], help="CORS methods, a JSON list")
    parser.add_argument("--allowed-headers", type=json.loads, default=["*"], help="CORS headers, a JSON list")
    parser.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template to use instead of the model's: a file, a shipped name "
                             f"({', '.join(sorted(SHIPPED_TEMPLATES))}), or the template text itself")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="let the model decide to call tools (tool_choice auto); needs --tool-call-parser")
    parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                        help="how the model writes tool calls, for tool_choice auto")
    parser.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="largest n a request may ask for")
    parser.add_argument("--max-num-queued-reqs", type=int, default=None,
                        help="answer 503 (overloaded_error, Retry-After) past this many requests waiting for their "
                             "first token (default: no limit)")
    parser.add_argument("--max-num-queued-tokens", type=int, default=None,
                        help="the same, counting the prompt tokens of those requests")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM, seconds to let in-flight requests finish before failing them")
    parser.add_argument("--disable-log-stats", action="store_true", help="no stats line every 10 s")
    parser.add_argument("--otlp-traces-endpoint", default=None,
                        help="export a span per request over OTLP/HTTP to this URL (default: OTEL_EXPORTER_OTLP_"
                             "TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT if set, else no tracing)")
    parser.add_argument("--otlp-traces-include-text", action="store_true",
                        help="also record prompt and completion text in spans (never done otherwise)")
    parser.add_argument("--log-format", choices=["text", "json"], default="text")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")


def run_from_cli(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model not in (DEFAULT_MODEL, args.model_tag):
            raise SystemExit(f"error: the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.api_key is None:
        args.api_key = os.environ.get("TOKENMILL_API_KEY") or None
    if args.max_n < 1:
        raise SystemExit("error: --max-n must be at least 1")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("error: --enable-auto-tool-choice needs --tool-call-parser")
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except OSError as e:
            raise SystemExit(f"error: cannot read --chat-template: {e}") from None
    configure_logging(args.log_format)
    try:
        config = EngineConfig.from_cli_args(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        return run(serve(args, config))
    except KeyboardInterrupt:
        return 0


def _bind(host: str, port: int) -> socket.socket:
    """Binds the port now, so that a taken port fails before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


STATS_LOG_INTERVAL_S = float(os.environ.get("TOKENMILL_STATS_LOG_INTERVAL_S", "10"))  # vLLM's 10 s


async def _log_stats(metrics: ServerMetrics) -> None:
    while True:
        line = metrics.stats_line(time.monotonic())
        if line:
            logger.info("%s", line)
        await asyncio.sleep(STATS_LOG_INTERVAL_S)


async def serve(args: argparse.Namespace, config: EngineConfig) -> int:
    try:
        model_path = resolve_model_path(config.model)
        sock = _bind(args.host, args.port)
    except (FileNotFoundError, OSError) as e:
        logger.error("%s", e)
        return 1
    lifecycle = Lifecycle(args.shutdown_timeout)
    root = LifecycleApp(lifecycle)
    # log_config=None: uvicorn's loggers keep our handler (text or JSON, with request ids)
    server = DrainingServer(uvicorn.Config(root, log_level=args.uvicorn_log_level, timeout_keep_alive=30,
                                           lifespan="off", timeout_graceful_shutdown=5, log_config=None), lifecycle)
    client = EngineClient(config)
    lifecycle.engine_alive = lambda: client.dead_reason is None
    # The port answers from now on: /health is 200 and /health/ready 503 while the model loads.
    http = asyncio.create_task(server.serve(sockets=[sock]))
    stats_task, state = None, None
    try:
        # The tokenizer loads here while the engine process loads the model.
        tokenizer_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, model_path, config.tokenizer))
        starting = asyncio.create_task(client.start())
        await asyncio.wait([starting, http], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # SIGTERM or Ctrl-C while loading
            starting.cancel()
            tokenizer_task.cancel()
            return 0
        try:
            ready = starting.result()
            tokenizer = await tokenizer_task
        except RuntimeError as e:
            tokenizer_task.cancel()
            logger.error("%s", e)
            return 1
        except Exception as e:  # noqa: BLE001 - any failure to load the tokenizer ends the server here
            logger.error("could not load the tokenizer: %s: %s", type(e).__name__, e)
            return 1
        logger.info("engine ready: max_model_len=%d, %d KV blocks of %d tokens", ready.max_model_len,
                    ready.num_blocks, ready.block_size)
        if args.chat_template is not None:
            tokenizer.chat_template = args.chat_template
        names = args.served_model_name or [DEFAULT_MODEL if config.model in (DEFAULT_MODEL, None) else config.model]
        state = ServerState(client, tokenizer, ready, names, config.model, args.max_n, args.api_key,
                            args.max_num_queued_reqs, args.max_num_queued_tokens,
                            make_tracer(args.otlp_traces_endpoint, args.otlp_traces_include_text),
                            config.reasoning, args.tool_call_parser if args.enable_auto_tool_choice else None)
        client.on_dead = lifecycle.engine_died
        lifecycle.fail_pending = client.fail_pending
        root.inner = build_app(state, args)
        if lifecycle.phase == "loading":
            lifecycle.phase = "ready"
        if not args.disable_log_stats:
            stats_task = asyncio.create_task(_log_stats(state.metrics))
        logger.info("serving %s on http://%s:%d", names[0], args.host, args.port)
        await http
        return lifecycle.exit_code
    finally:
        if stats_task is not None:
            stats_task.cancel()
        if state is not None and state.tracer is not None:
            state.tracer.shutdown()
        if not http.done():
            server.should_exit = True
            await http
        client.shutdown()
        sock.close()


# ============================== app ==============================

@dataclass
class ServerState:
    client: EngineClient
    tokenizer: object
    engine: EngineReady
    model_names: list[str]
    model_root: str
    max_n: int = DEFAULT_MAX_N
    api_key: str | None = None
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    tracer: object | None = None  # a RequestTracer when tracing is on
    reasoning: ReasoningSpec | None = None  # --reasoning-parser
    tool_call_parser: str | None = None  # set only with --enable-auto-tool-choice
    metrics: ServerMetrics = field(init=False)
    _token_strs: dict[int, str] = field(default_factory=dict, init=False)

    def __post_init__(self):
        e = self.engine
        self.metrics = ServerMetrics(self.model_names[0], e.max_model_len, e.num_blocks, e.block_size,
                                     e.enable_prefix_caching)
        self.client.metrics = self.metrics

    @functools.cached_property
    def grammar_compiler(self):
        from tokenmill.engine.structured_output import GrammarCompiler
        return GrammarCompiler(self.tokenizer, self.engine.vocab_size)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names and model != self.model_root:
            raise ModelNotFound(model)

    def token_str(self, token_id: int) -> str:
        s = self._token_strs.get(token_id)
        if s is None:
            s = self._token_strs[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int) -> None:
        """The engine's own checks (context length, logprobs, vocabulary, priority), before anything is sent."""
        e = self.engine
        validate_request(prompt_ids, params, priority, e.max_model_len, e.max_logprobs, e.vocab_size,
                         e.scheduling_policy, e.num_blocks * e.block_size, self.reasoning is not None)

    def check_queue(self, prompts: list[list[int]]) -> None:
        """Backpressure: refuse work past the queue limits instead of queueing without bound."""
        queued_reqs, queued_tokens = self.client.num_queued_requests, self.client.num_queued_tokens
        if self.max_num_queued_reqs is not None and queued_reqs + len(prompts) > self.max_num_queued_reqs:
            raise Overloaded(f"The server is overloaded: {queued_reqs} requests are queued "
                             f"(--max-num-queued-reqs {self.max_num_queued_reqs}); retry later.")
        new_tokens = sum(len(ids) for ids in prompts)
        if self.max_num_queued_tokens is not None and queued_tokens + new_tokens > self.max_num_queued_tokens:
            raise Overloaded(f"The server is overloaded: {queued_tokens} prompt tokens are queued "
                             f"(--max-num-queued-tokens {self.max_num_queued_tokens}); retry later.")


class ModelNotFound(Exception):
    def __init__(self, model: str):
        super().__init__(f"The model `{model}` does not exist.")


def build_app(state: ServerState, args: argparse.Namespace | None = None) -> FastAPI:
    app = FastAPI(title="tokenmill", version=tokenmill.__version__)
    _add_error_handlers(app)
    _add_routes(app, state)
    app.add_middleware(RequestIdMiddleware)
    if state.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.api_key)
    if args is not None:  # outermost, so that preflight requests never need the key
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins, allow_methods=args.allowed_methods,
                           allow_headers=args.allowed_headers, allow_credentials=args.allow_credentials)
    return app


# ============================== errors ==============================

def _validation_error_response(exc: RequestValidationError) -> Response:
    """pydantic's 422 becomes OpenAI's 400, naming the first offending field."""
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [x for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx", {}).get("error", "")
        return error_response(400, f"The request body is not valid JSON: {ctx}".rstrip(": "),
                              "invalid_request_error")
    param = str(loc[0]) if loc else None
    where = ".".join(str(x) for x in loc) or "body"
    if first.get("type") == "missing":
        message = f"{where}: field required"
    else:
        message = f"{where}: {first.get('msg')} (got {first.get('input')!r})"
    return error_response(400, message, "invalid_request_error", param)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return _validation_error_response(exc)

    @app.exception_handler(ParamError)
    async def on_param_error(request: Request, exc: ParamError):
        return error_response(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(ModelNotFound)
    async def on_model_not_found(request: Request, exc: ModelNotFound):
        return error_response(404, str(exc), "NotFoundError", "model")

    @app.exception_handler(Overloaded)
    async def on_overloaded(request: Request, exc: Overloaded):
        response = error_response(503, str(exc), "overloaded_error")
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError):
        return error_response(503, f"The server cannot serve requests: {exc}", "service_unavailable_error")

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        type_ = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_)

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, exc: Exception):
        logger.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(500, "Internal server error; see the server log.", "internal_server_error")


# ============================== middleware (pure ASGI: streaming and disconnects pass through untouched) ====

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
                response = error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                          "authentication_error")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


# ============================== client disconnects ==============================

class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(receive, work: Awaitable):
    """Runs `work`; if the client disconnects first, cancels it (its cleanup aborts the engine requests) and
    raises ClientDisconnected."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not work_task.done():
            work_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work_task
    if work_task in done:
        return work_task.result()
    raise ClientDisconnected()


class EventStreamResponse(Response):
    """Server-sent events from an async generator, which is closed (aborting its engine requests) as soon as the
    client goes away, even while no event is due."""
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", **(headers or {})})

    async def __call__(self, scope, receive, send) -> None:
        async def pump():
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnected(receive, pump())
        except (ClientDisconnected, OSError):
            pass
        finally:
            await self.events.aclose()


# ============================== routes ==============================

def _add_routes(app: FastAPI, state: ServerState) -> None:
    server = OpenAIServing(state)

    @app.get("/health")
    async def health():
        if not state.client.is_alive:
            raise EngineDeadError(state.client.dead_reason or "the engine is not running")
        return Response(status_code=200)

    @app.get("/dashboard")
    async def dashboard():
        return Response(DASHBOARD_HTML, media_type="text/html")

    @app.get("/version")
    async def version():
        return {"version": tokenmill.__version__}

    @app.get("/metrics")
    async def metrics():
        state.metrics.record_step(await state.client.stats())
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models():
        created = int(time.time())
        cards = [p.ModelCard(name, created, state.model_root, state.engine.max_model_len) for name in state.model_names]
        return _json(p.ModelList(cards))

    @app.post("/v1/completions")
    async def create_completion(body: p.CompletionRequest, raw: Request):
        return await server.completion(body, raw)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: p.ChatCompletionRequest, raw: Request):
        return await server.chat(body, raw)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest):
        state.check_model(body.model)
        if body.messages is not None:
            text, ids = render_chat(state.tokenizer, body.messages, body.add_generation_prompt,
                                    body.continue_final_message, body.chat_template_kwargs, body.tools)
            if body.add_special_tokens:
                ids = state.tokenizer.encode(text, add_special_tokens=True)
        elif body.prompt is not None:
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            raise ParamError("either prompt or messages is required", "prompt")
        strs = [state.token_str(t) for t in ids] if body.return_token_strs else None
        return _json(p.TokenizeResponse(len(ids), state.engine.max_model_len, ids, strs))

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest):
        state.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < state.engine.vocab_size]
        if bad:
            raise ParamError(f"token id {bad[0]} is out of vocabulary (size {state.engine.vocab_size})", "tokens")
        return _json(p.DetokenizeResponse(state.tokenizer.decode(body.tokens)))


def _json(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def _sse(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _sse_error(exc: Exception, request_id: str) -> bytes:
    """The last event of a stream that failed after its 200 status line went out."""
    if isinstance(exc, ParamError):
        info = p.ErrorInfo(str(exc), "invalid_request_error", exc.param, 400)
    elif isinstance(exc, EngineDeadError):
        info = p.ErrorInfo(f"The server cannot serve requests: {exc}", "service_unavailable_error", None, 503)
    else:
        logger.exception("internal error while streaming %s", request_id)
        info = p.ErrorInfo("Internal server error; see the server log.", "internal_server_error", None, 500)
    return _sse(p.ErrorResponse(info))


# ============================== completions and chat ==============================

@dataclass
class _Choice:
    """A choice being accumulated for a non-streaming response."""
    text: str = ""
    num_tokens: int = 0
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class OpenAIServing:
    def __init__(self, state: ServerState):
        self.state = state

    # ---- shared ----

    def sampling_params(self, req: p.SamplingFields, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        if req.n > self.state.max_n:
            raise ParamError(f"n must be at most {self.state.max_n}, got {req.n}", "n")
        logit_bias = None
        if req.logit_bias:
            try:
                logit_bias = {int(k): float(v) for k, v in req.logit_bias.items()}
            except ValueError as e:
                raise ParamError("logit_bias keys must be token ids", "logit_bias") from e
            bad = [t for t in logit_bias if not 0 <= t < self.state.engine.vocab_size]
            if bad:
                raise ParamError(f"logit_bias token id {bad[0]} is out of vocabulary", "logit_bias")
            if any(not -100 <= v <= 100 for v in logit_bias.values()):
                raise ParamError("logit_bias values must be in [-100, 100]", "logit_bias")
        vocab = self.state.engine.vocab_size
        bad = [t for t in req.stop_token_ids or [] if not 0 <= t < vocab]
        if bad:
            raise ParamError(f"stop_token_ids: token id {bad[0]} is out of vocabulary (size {vocab})",
                             "stop_token_ids")
        for name in ("seed", "top_k", "min_tokens", "priority", "thinking_token_budget"):
            value = getattr(req, name)
            if value is not None and not -2**63 <= value < 2**63:
                raise ParamError(f"{name} must fit in 64 bits, got {value}", name)
        top_k = req.top_k or 0
        if top_k >= vocab:  # keeps every token, as no top-k at all does
            top_k = 0
        structured = self.structured_outputs(req)
        if tool_constraint is not None:
            if structured is not None:
                raise ParamError("tool_choice required or a named function cannot be combined with another "
                                 "structured-output constraint", "tool_choice")
            try:
                self.state.grammar_compiler.compile(tool_constraint)
            except ParamError as e:  # the schema came from a tool's parameters
                raise ParamError(f"{e} (in the tools' parameters)", "tools") from None
            structured = tool_constraint
        return SamplingParams(
            structured_outputs=structured, thinking_token_budget=req.thinking_token_budget,
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
            min_p=req.min_p or 0.0, presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens)

    def structured_outputs(self, req: p.SamplingFields) -> StructuredOutputsParams | None:
        """The request's constraint, from whichever field carries it; compiled here first, so that an invalid
        schema, regex or grammar is a 400 quoting the compiler (and the engine finds it in the cache)."""
        specs = []
        fmt = req.response_format
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_object":
                specs.append(StructuredOutputsParams(json_object=True))
            elif fmt.type == "json_schema":
                if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                    raise ParamError("response_format json_schema needs json_schema.schema", "response_format")
                specs.append(StructuredOutputsParams(json=fmt.json_schema.schema_))
            else:
                raise ParamError(f"response_format type must be text, json_object or json_schema, got {fmt.type!r}",
                                 "response_format")
        for name, field_name in (("json", "guided_json"), ("regex", "guided_regex"), ("choice", "guided_choice"),
                                 ("grammar", "guided_grammar")):
            if getattr(req, field_name) is not None:
                specs.append(StructuredOutputsParams(**{name: getattr(req, field_name)}))
        so = req.structured_outputs
        if so is not None:
            specs.append(StructuredOutputsParams(json=so.json_, json_object=bool(so.json_object), regex=so.regex,
                                                 choice=so.choice, grammar=so.grammar))
        if not specs:
            return None
        if len(specs) > 1:
            raise ParamError("give one structured-output constraint: response_format, guided_json, guided_regex, "
                             "guided_choice, guided_grammar or structured_outputs", "response_format")
        self.state.grammar_compiler.compile(specs[0])
        return specs[0]

    def _start(self, request_id: str, prompts: list[list[int]], params: SamplingParams, priority: int,
               raw: Request, operation: str) -> GenerationStream:
        """Validates every prompt first, so that a bad one fails the request before anything reaches the engine."""
        state = self.state
        state.client.check_alive()
        for ids in prompts:
            state.validate(ids, params, priority)
        state.check_queue([ids for ids in prompts for _ in range(params.n)])
        stream = state.client.generate(request_id, prompts, params, state.tokenizer, priority)
        if state.tracer is not None:
            stream.trace = RequestTrace(
                request_id, operation, state.model_names[0], dict(raw.headers), params.max_tokens,
                params.temperature, params.top_p, params.n, input_tokens=sum(len(ids) for ids in prompts))
            if state.tracer.include_text:
                stream.trace.prompt_text = "".join(state.tokenizer.decode(ids) for ids in prompts)
            stream.on_close = self._record_trace
        return stream

    def _record_trace(self, stream: GenerationStream) -> None:
        t = stream.trace
        samples = sorted(stream.samples.values(), key=lambda s: s.index)
        t.output_tokens = sum(s.num_tokens for s in samples)
        t.finish_reasons = [s.finish_reason or "abort" for s in samples]
        if self.state.tracer.include_text:
            t.completion_text = "".join(s.detokenizer.text for s in samples)
        try:
            self.state.tracer.record(t)
        except Exception:  # noqa: BLE001 - tracing must never fail a request
            logger.exception("could not record the trace of %s", stream.request_id)

    @staticmethod
    def _usage(prompts: list[list[int]], num_completion_tokens: int) -> p.Usage:
        num_prompt = sum(len(ids) for ids in prompts)
        return p.Usage(num_prompt, num_completion_tokens, num_prompt + num_completion_tokens)

    @staticmethod
    async def _collect(stream: GenerationStream, num_choices: int) -> list[_Choice]:
        choices = [_Choice() for _ in range(num_choices)]
        with stream:
            async for deltas in stream:
                for d in deltas:
                    c = choices[d.index]
                    c.text += d.text
                    c.num_tokens += len(d.token_ids)
                    if d.logprobs:
                        c.logprobs.extend(d.logprobs)
                    if d.prompt_logprobs:
                        c.prompt_logprobs.extend(d.prompt_logprobs)
                    if d.finish_reason is not None:
                        c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        return choices

    async def _run_to_completion(self, raw: Request, stream: GenerationStream, num_choices: int):
        try:
            return await until_disconnected(raw.receive, self._collect(stream, num_choices))
        except ClientDisconnected:
            logger.info("client went away; aborted %s", stream.request_id)
            return Response(status_code=499)

    # ---- /v1/completions ----

    def _completion_prompts(self, prompt) -> list[list[int]]:
        tok = self.state.tokenizer
        if isinstance(prompt, str):
            return [tok.encode(prompt, add_special_tokens=True)]
        if not prompt:
            raise ParamError("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            return [tok.encode(s, add_special_tokens=True) for s in prompt]
        return [list(ids) for ids in prompt]

    async def completion(self, req: p.CompletionRequest, raw: Request):
        state = self.state
        state.check_model(req.model)
        prompts = self._completion_prompts(req.prompt)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params = self.sampling_params(req, req.max_tokens, req.logprobs, prompt_logprobs)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = self._start(request_id, prompts, params, req.priority, raw, "text_completion")
        echo_texts = [state.tokenizer.decode(ids) for ids in prompts] if req.echo else None
        model, created, n = state.model_names[0], int(time.time()), params.n
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(self._completion_events(stream, prompts, echo_texts, model, created,
                                                               include_usage))
        choices = await self._run_to_completion(raw, stream, len(prompts) * n)
        if isinstance(choices, Response):
            return choices
        out = []
        for i, c in enumerate(choices):
            prompt_ids = prompts[i // n]
            prefix = echo_texts[i // n] if echo_texts else ""
            logprobs = None
            if req.logprobs is not None:
                entries = []
                if req.echo:
                    lp = c.prompt_logprobs[-len(prompt_ids):]
                    lp = [None] * (len(prompt_ids) - len(lp)) + lp
                    entries = [(t, e) for t, e in zip(prompt_ids, lp)]
                entries += [(e[0], e) for e in c.logprobs]
                logprobs = self._completion_logprobs(entries, 0)
            out.append(p.CompletionChoice(i, prefix + c.text, logprobs, c.finish_reason, c.stop_reason))
        usage = self._usage(prompts, sum(c.num_tokens for c in choices))
        return _json(p.CompletionResponse(request_id, created, model, out, usage))

    def _completion_logprobs(self, entries: list[tuple[int, tuple | None]], offset: int) -> p.CompletionLogprobs:
        """entries: (token id, engine logprob entry or None); offset: text offset of the first token."""
        out = p.CompletionLogprobs()
        for token_id, e in entries:
            s = self.state.token_str(token_id)
            out.tokens.append(s)
            out.text_offset.append(offset)
            offset += len(s)
            if e is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(e[1])
            top = {self.state.token_str(t): lp for t, lp in zip(e[3], e[4])}
            top.setdefault(s, e[1])
            out.top_logprobs.append(top)
        return out

    async def _completion_events(self, stream: GenerationStream, prompts, echo_texts, model: str, created: int,
                                 include_usage: bool) -> AsyncIterator[bytes]:
        n = stream.params.n
        num_tokens = 0
        offsets = [0] * (len(prompts) * n)
        with stream:
            try:
                if echo_texts:
                    yield b"".join(_sse(p.CompletionResponse(stream.request_id, created, model, [
                        p.CompletionChoice(i, echo_texts[i // n], None, None)])) for i in range(len(offsets)))
                    offsets = [len(echo_texts[i // n]) for i in range(len(offsets))]
                async for deltas in stream:
                    events = []
                    for d in deltas:
                        num_tokens += len(d.token_ids)
                        logprobs = None
                        if d.logprobs:
                            logprobs = self._completion_logprobs([(e[0], e) for e in d.logprobs], offsets[d.index])
                            offsets[d.index] += sum(len(t) for t in logprobs.tokens)
                        if d.text or logprobs is not None:
                            events.append(_sse(p.CompletionResponse(stream.request_id, created, model, [
                                p.CompletionChoice(d.index, d.text, logprobs, None)])))
                        if d.finish_reason is not None:
                            events.append(_sse(p.CompletionResponse(stream.request_id, created, model, [
                                p.CompletionChoice(d.index, "", None, d.finish_reason, d.stop_reason)])))
                    if events:
                        yield b"".join(events)
            except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream, then end it
                yield _sse_error(e, stream.request_id) + _DONE
                return
        if include_usage:
            yield _sse(p.CompletionResponse(stream.request_id, created, model, [], self._usage(prompts, num_tokens)))
        yield _DONE

    # ---- /v1/chat/completions ----

    async def chat(self, req: p.ChatCompletionRequest, raw: Request):
        state = self.state
        state.check_model(req.model)
        tool_mode, named_tool, tool_constraint = self._tool_choice(req)
        prompt_text, prompt_ids = render_chat(state.tokenizer, req.messages, req.add_generation_prompt,
                                              req.continue_final_message, req.chat_template_kwargs, req.tools)
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise ParamError("top_logprobs needs logprobs set to true", "top_logprobs")
            if not 0 <= req.top_logprobs <= state.engine.max_logprobs:
                raise ParamError(f"top_logprobs must be in [0, {state.engine.max_logprobs}], got {req.top_logprobs}",
                                 "top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens is not None and max_tokens < 1:
            param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise ParamError(f"{param} must be at least 1, got {max_tokens}", param)
        params = self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                      tool_constraint=tool_constraint)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"

        def output_parser() -> ChatOutputParser:
            splitter = ReasoningSplitter(state.reasoning, prompt_text) if state.reasoning is not None else None
            tool_parser = TOOL_PARSERS[state.tool_call_parser]() if tool_mode == "auto" else None
            return ChatOutputParser(splitter, req.include_reasoning, tool_mode, tool_parser, named_tool)

        stream = self._start(request_id, [prompt_ids], params, req.priority, raw, "chat")
        model, created = state.model_names[0], int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStreamResponse(self._chat_events(stream, prompt_ids, model, created, include_usage,
                                                         output_parser))
        choices = await self._run_to_completion(raw, stream, params.n)
        if isinstance(choices, Response):
            return choices
        out = []
        for i, c in enumerate(choices):
            parser = output_parser()
            parser.feed(c.text)
            parser.finish()
            out.append(p.ChatChoice(i, parser.message(), self._chat_logprobs(c.logprobs) if req.logprobs else None,
                                    parser.finish_reason(c.finish_reason), c.stop_reason))
        usage = self._usage([prompt_ids], sum(c.num_tokens for c in choices))
        return _json(p.ChatCompletionResponse(request_id, created, model, out, usage))

    def _tool_choice(self, req: p.ChatCompletionRequest) -> tuple[str, str | None, StructuredOutputsParams | None]:
        """(tool mode, named function, the grammar that enforces it), with vLLM's defaults and errors."""
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if req.tools else "none"
        if not req.tools:
            if choice != "none":
                raise ParamError("When using `tool_choice`, `tools` must be set.", "tool_choice")
            return "none", None, None
        validate_tools(req.tools)
        if isinstance(choice, dict):
            fn = choice.get("function")
            if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ParamError('tool_choice must be "none", "auto", "required" or '
                                 '{"type": "function", "function": {"name": ...}}', "tool_choice")
            schema = named_tool_schema(req.tools, fn["name"])
            return "named", fn["name"], StructuredOutputsParams(json=schema)
        if choice == "required":
            return "required", None, StructuredOutputsParams(json=required_tools_schema(req.tools,
                                                                                        req.parallel_tool_calls))
        if choice == "auto":
            if self.state.tool_call_parser is None:
                raise ParamError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                 "to be set", "tool_choice")
            return "auto", None, None
        if choice == "none":
            return "none", None, None
        raise ParamError(f'tool_choice must be "none", "auto", "required" or a named function, got {choice!r}',
                         "tool_choice")

    def _chat_logprobs(self, entries: list[tuple]) -> p.ChatLogprobs:
        content = []
        for token_id, logprob, _rank, top_ids, top_lps in entries:
            s = self.state.token_str(token_id)
            top = [p.TopLogprob(self.state.token_str(t), lp, list(self.state.token_str(t).encode()))
                   for t, lp in zip(top_ids, top_lps)]
            content.append(p.ChatLogprobToken(s, logprob, list(s.encode()), top))
        return p.ChatLogprobs(content)

    async def _chat_events(self, stream: GenerationStream, prompt_ids: list[int], model: str, created: int,
                           include_usage: bool, output_parser) -> AsyncIterator[bytes]:
        rid = stream.request_id
        want_logprobs = stream.params.logprobs is not None
        num_tokens = 0
        parsers = [output_parser() for _ in range(stream.params.n)]

        def chunk(index: int, delta: p.DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None) -> bytes:
            return _sse(p.ChatCompletionChunk(rid, created, model, [
                p.ChatChunkChoice(index, delta, logprobs, finish_reason, stop_reason)]))

        with stream:
            try:
                yield b"".join(chunk(i, p.DeltaMessage(role="assistant", content=""))
                               for i in range(stream.params.n))
                async for deltas in stream:
                    events = []
                    for d in deltas:
                        num_tokens += len(d.token_ids)
                        logprobs = self._chat_logprobs(d.logprobs) if want_logprobs and d.logprobs else None
                        parser = parsers[d.index]
                        parts = parser.feed(d.text) if d.text else []
                        if d.finish_reason is not None:
                            parts += parser.finish()
                        if logprobs is not None and not parts:
                            parts = [p.DeltaMessage()]  # the text is held back for now; its logprobs are not
                        for j, part in enumerate(parts):
                            events.append(chunk(d.index, part, logprobs if j == 0 else None))
                        if d.finish_reason is not None:
                            events.append(chunk(d.index, p.DeltaMessage(), None, parser.finish_reason(d.finish_reason),
                                                d.stop_reason))
                    if events:
                        yield b"".join(events)
            except Exception as e:  # noqa: BLE001 - the status line is sent: report in the stream, then end it
                yield _sse_error(e, stream.request_id) + _DONE
                return
        if include_usage:
            yield _sse(p.ChatCompletionUsageChunk(rid, created, model, self._usage([prompt_ids], num_tokens)))
        yield _DONE

