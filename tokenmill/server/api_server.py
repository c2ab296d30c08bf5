"""The OpenAI-compatible app of `tokenmill serve` (FastAPI): this module builds it (routes, error handlers,
middleware) from a ServerState and nothing else; each endpoint family's work is in its serving_*.py module, and
the process's start-up (the port, the engine process, uvicorn) in launch.py.

This process tokenizes, applies chat templates, detokenizes and matches stop strings; the engine core runs in its
own process (tokenmill/engine/core_proc.py), reached through EngineClient. It imports no torch."""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import tokenmill
from tokenmill import envs
from tokenmill.api import chat_protocol as chp
from tokenmill.api import completion_protocol as cp
from tokenmill.api.errors import add_error_handlers
from tokenmill.server import tokenization_protocol as tp
from tokenmill.server.invocations import add_invocations_route
from tokenmill.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tokenmill.server.middleware import (
    ApiKeyMiddleware,
    BodySizeLimitMiddleware,
    RequestIdMiddleware,
    ServerLoadMiddleware,
)
from tokenmill.server.openapi import install_openapi
from tokenmill.server.orca import REQUEST_HEADER as ORCA_FORMAT_HEADER
from tokenmill.server.orca import load_report
from tokenmill.server.server_state import ServerState
from tokenmill.server.serving_chat import OpenAIServingChat
from tokenmill.server.serving_completion import OpenAIServingCompletion
from tokenmill.server.serving_embedding import add_embedding_routes
from tokenmill.server.serving_messages import add_messages_routes
from tokenmill.server.serving_models import OpenAIServingModels, add_model_routes
from tokenmill.server.serving_responses import add_responses_routes
from tokenmill.server.serving_score import add_score_routes
from tokenmill.server.serving_tokenization import OpenAIServingTokenization
from tokenmill.server.sleep_mode import SleepControl, SleepGateMiddleware, add_sleep_routes

# One self-contained page (no CDN): live charts computed in the browser from /metrics.
DASHBOARD_HTML = (Path(__file__).parent / "dashboard.html").read_bytes()


def build_app(state: ServerState) -> FastAPI:
    config = state.config
    docs = {"docs_url": None, "redoc_url": None, "openapi_url": None} if config.disable_fastapi_docs else {}
    app = FastAPI(title="tokenmill", version=tokenmill.__version__, **docs)
    add_error_handlers(app)
    install_openapi(app, bool(config.api_key))
    app.state.sleep = SleepControl(state)
    _add_routes(app, state)
    app.add_middleware(BodySizeLimitMiddleware, limit=config.max_request_body_bytes)
    app.add_middleware(SleepGateMiddleware, control=app.state.sleep, paths=LOAD_TRACKED_PATHS)
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
    "/v1/completions", "/v1/chat/completions", "/v1/chat/completions/batch", "/v1/responses", "/v1/messages",
    "/v1/embeddings",
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

    if envs.VLLM_SERVER_DEV_MODE:  # vLLM's development endpoints: served only when asked for, as in vLLM
        @app.post("/reset_prefix_cache")
        async def reset_prefix_cache():
            """Every cached prefix forgotten (its KV events say AllBlocksCleared); 200 with no body, as vLLM."""
            state.metrics.record_step(await state.client.reset_prefix_cache())
            return Response(status_code=200)

        add_sleep_routes(app, app.state.sleep)  # POST /sleep, POST /wake_up, GET /is_sleeping

    if envs.VLLM_TORCH_PROFILER_DIR:  # as vLLM: served only when a directory for the traces is set
        @app.post("/start_profile")
        async def start_profile():
            """torch's profiler records the engine process from now on; 200 with no body, as vLLM."""
            await state.client.start_profile()
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile():
            """The recording ends; its Chrome trace is in VLLM_TORCH_PROFILER_DIR when this answers."""
            await state.client.stop_profile()
            return Response(status_code=200)

    @app.post("/v1/completions")
    async def create_completion(body: cp.CompletionRequest, raw: Request):
        return _with_load_report(await completions.create_completion(body, raw), raw, state)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: chp.ChatCompletionRequest, raw: Request):
        return _with_load_report(await chat.create_chat_completion(body, raw), raw, state)

    @app.post("/v1/chat/completions/batch")
    async def create_batch_chat_completion(body: chp.BatchChatCompletionRequest, raw: Request):
        return await chat.create_batch_chat_completion(body, raw)

    @app.get("/load")
    async def server_load():
        """vLLM's: the requests in flight (0 without --enable-server-load-tracking)."""
        return {"server_load": state.server_load}

    add_responses_routes(app, state)
    add_messages_routes(app, state)
    add_embedding_routes(app, state)
    add_score_routes(app, state)

    @app.post("/tokenize")
    async def tokenize(body: tp.TokenizeRequest):
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: tp.DetokenizeRequest):
        return tokenization.detokenize(body)

    if state.config.enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            return JSONResponse(tokenization.tokenizer_info())  # not msgspec: model_max_length can pass 2**64

    add_invocations_route(app, state.engine.runner)  # last: it dispatches to the routes above
