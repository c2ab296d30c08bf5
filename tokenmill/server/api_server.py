"""`tokenmill serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn). This module builds the app, holds
its routes, and starts the server; each endpoint family's work is in its serving_*.py module.

This process tokenizes, applies chat templates, detokenizes and matches stop strings; the engine core runs in its
own process (tokenmill/engine/core_proc.py), reached through EngineClient. It imports no torch. The port opens
before the model loads, so that /health answers while /health/ready waits for the engine."""
from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import tokenmill
from tokenmill import envs
from tokenmill.config import DEFAULT_MODEL, EngineConfig
from tokenmill.models.paths import resolve_model_path
from tokenmill.server import protocol as p
from tokenmill.server.chat_utils import load_chat_template
from tokenmill.server.engine_client import EngineClient
from tokenmill.server.errors import add_error_handlers
from tokenmill.server.invocations import add_invocations_route
from tokenmill.server.lifecycle import DrainingServer, Lifecycle, LifecycleApp
from tokenmill.server.logs import configure_logging
from tokenmill.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    RequestIdMiddleware,
    ServerLoadMiddleware,
)
from tokenmill.server.openapi import install_openapi
from tokenmill.server.orca import REQUEST_HEADER as ORCA_FORMAT_HEADER
from tokenmill.server.orca import load_report
from tokenmill.server.server_config import ServerConfig
from tokenmill.server.server_state import ServerState
from tokenmill.server.serving_chat import OpenAIServingChat
from tokenmill.server.serving_completion import OpenAIServingCompletion
from tokenmill.server.serving_embedding import add_embedding_routes
from tokenmill.server.serving_models import OpenAIServingModels, add_model_routes
from tokenmill.server.serving_responses import add_responses_routes
from tokenmill.server.serving_score import add_score_routes
from tokenmill.server.serving_tokenization import OpenAIServingTokenization
from tokenmill.server.tracing import make_tracer
from tokenmill.heap import freeze_startup_heap
from tokenmill.tokenizer import load_tokenizer

logger = logging.getLogger("tokenmill.server")

# One self-contained page (no CDN): live charts computed in the browser from /metrics.
DASHBOARD_HTML = (Path(__file__).parent / "dashboard.html").read_bytes()


# ============================== the app ==============================

def build_app(state: ServerState) -> FastAPI:
    config = state.config
    app = FastAPI(title="tokenmill", version=tokenmill.__version__)
    add_error_handlers(app)
    install_openapi(app, bool(config.api_key))
    _add_routes(app, state)
    app.add_middleware(BodySizeLimitMiddleware, limit=config.max_request_body_bytes)
    if config.enable_server_load_tracking:
        app.add_middleware(ServerLoadMiddleware, state=state, paths=LOAD_TRACKED_PATHS)
    app.add_middleware(RequestIdMiddleware)
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    # outermost, so that preflight requests never need the key
    app.add_middleware(CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=config.allowed_methods,
                       allow_headers=config.allowed_headers, allow_credentials=config.allow_credentials)
    return app


# The routes GET /load counts (vLLM's load_aware_call): those that run the model.
LOAD_TRACKED_PATHS = frozenset({
    "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses", "/v1/embeddings",
    "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/invocations"})


def _with_load_report(response: Response, raw: Request, state: ServerState) -> Response:
    """The ORCA header on a JSON answer whose request asked for it (vLLM: completions and chat, not streamed)."""
    metrics_format = raw.headers.get(ORCA_FORMAT_HEADER)
    if metrics_format and response.status_code == 200 and response.media_type == "application/json":
        s = state.metrics.last_stats
        response.headers.update(load_report(metrics_format, s.kv_cache_usage if s else 0.0,
                                            s.num_waiting if s else 0))
    return response


def _add_routes(app: FastAPI, state: ServerState) -> None:
    """/health and /health/ready are answered before the app, by LifecycleApp."""
    completions = OpenAIServingCompletion(state)
    chat = OpenAIServingChat(state)
    tokenization = OpenAIServingTokenization(state)

    @app.get("/dashboard")
    async def dashboard():
        return Response(DASHBOARD_HTML, media_type="text/html")

    @app.get("/version")
    async def version():
        return {"version": tokenmill.__version__}

    @app.get("/metrics")
    async def metrics():
        # The engine reports its state with every change (each step, each abort); it is asked only before the first
        # report, so a scrape never waits for a step to end.
        if state.metrics.last_stats is None:
            state.metrics.record_step(await state.client.stats())
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    # /v1/models, and the LoRA adapters (loaded at start-up by serve(): --lora-modules)
    app.state.models = OpenAIServingModels(state)
    add_model_routes(app, app.state.models, envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING)

    @app.post("/v1/completions")
    async def create_completion(body: p.CompletionRequest, raw: Request):
        return _with_load_report(await completions.create_completion(body, raw), raw, state)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: p.ChatCompletionRequest, raw: Request):
        return _with_load_report(await chat.create_chat_completion(body, raw), raw, state)

    @app.post("/v1/chat/completions/batch")
    async def create_batch_chat_completion(body: p.BatchChatCompletionRequest, raw: Request):
        return await chat.create_batch_chat_completion(body, raw)

    @app.get("/load")
    async def server_load():
        """vLLM's: the requests in flight (0 without --enable-server-load-tracking)."""
        return {"server_load": state.server_load}

    add_responses_routes(app, state)
    add_embedding_routes(app, state)
    add_score_routes(app, state)

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest):
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest):
        return tokenization.detokenize(body)

    if state.config.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return JSONResponse(tokenization.tokenizer_info())  # not msgspec: model_max_length can pass 2**64

    add_invocations_route(app, state.engine.runner)  # last: it dispatches to the routes above


# ============================== start-up ==============================

def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model (same as --model)")
    EngineConfig.add_cli_args(parser)
    ServerConfig.add_cli_args(parser)


def run_from_cli(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model not in (DEFAULT_MODEL, args.model_tag):
            raise SystemExit(f"error: the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    if args.api_key is None:
        args.api_key = envs.TOKENMILL_API_KEY
    if args.chat_template is not None:
        try:
            args.chat_template = load_chat_template(args.chat_template)
        except OSError as e:
            raise SystemExit(f"error: cannot read --chat-template: {e}") from None
    try:
        server_config = ServerConfig.from_cli_args(args)
        engine_config = EngineConfig.from_cli_args(args)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if server_config.lora_modules and not engine_config.enable_lora:
        raise SystemExit("error: --lora-modules needs --enable-lora")
    configure_logging(server_config.log_format)
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    try:
        return run(serve(server_config, engine_config))
    except KeyboardInterrupt:
        return 0


# The kernel's send buffer of each connection (accepted sockets inherit it). Left to autotuning it grows to
# tcp_wmem's maximum (4 MiB here) for a client that stops reading, and the server would only notice the stall
# (--stream-stall-timeout) once that much of the stream sat unread. 64 KiB still carries 640 KB/s at 100 ms RTT;
# a token stream with 20 logprobs per token at 100 tokens/s is 70 KB/s.
SEND_BUFFER_BYTES = 64 * 1024


def _bind(host: str, port: int) -> socket.socket:
    """Binds the port now, so that a taken port fails before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES // 2)  # Linux doubles what it is given
    sock.bind((host, port))
    return sock


async def _log_stats(metrics: ServerMetrics) -> None:
    interval_s = envs.TOKENMILL_STATS_LOG_INTERVAL_S
    while True:
        line = metrics.stats_line(time.monotonic())
        if line:
            logger.info("%s", line)
        await asyncio.sleep(interval_s)


async def serve(config: ServerConfig, engine_config: EngineConfig) -> int:
    try:
        model_path = resolve_model_path(engine_config.model)
        sock = _bind(config.host, config.port)
    except (FileNotFoundError, OSError) as e:
        logger.error("%s", e)
        return 1
    lifecycle = Lifecycle(config.shutdown_timeout)
    root = LifecycleApp(lifecycle)
    # log_config=None: uvicorn's loggers keep our handler (text or JSON, with request ids)
    server = DrainingServer(uvicorn.Config(root, log_level=config.uvicorn_log_level, timeout_keep_alive=30,
                                           lifespan="off", timeout_graceful_shutdown=5, log_config=None), lifecycle)
    client = EngineClient(engine_config)
    client.stream_stall_timeout_s = config.stream_stall_timeout
    lifecycle.engine_alive = lambda: client.dead_reason is None
    # The port answers from now on: /health is 200 and /health/ready 503 while the model loads.
    http = asyncio.create_task(server.serve(sockets=[sock]))
    stats_task, state = None, None
    try:
        # The tokenizer loads here while the engine process loads the model.
        tokenizer_task = asyncio.create_task(asyncio.to_thread(load_tokenizer, model_path, engine_config.tokenizer))
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
        if config.chat_template is not None:
            tokenizer.chat_template = config.chat_template
        state = ServerState(client, tokenizer, ready, config, engine_config.model, engine_config.reasoning,
                            make_tracer(config.otlp_traces_endpoint, config.otlp_traces_include_text))
        client.on_dead = lifecycle.engine_died
        lifecycle.fail_pending = client.fail_pending
        app = build_app(state)
        try:
            await app.state.models.load_static(config.lora_modules or [])
        except Exception as e:  # noqa: BLE001 - an adapter that cannot be served ends the start-up, as in vLLM
            logger.error("--lora-modules: %s", e)
            return 1
        root.inner = app
        freeze_startup_heap()
        if lifecycle.phase == "loading":
            lifecycle.phase = "ready"
        if not config.disable_log_stats:
            stats_task = asyncio.create_task(_log_stats(state.metrics))
        logger.info("serving %s on http://%s:%d", state.model_names[0], config.host, config.port)
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
