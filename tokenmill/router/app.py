"""`tokenmill router`: the app (OpenAI routes proxied to the replicas, health, metrics), its start-up and CLI.

Start-up: load the served model's tokenizer (no weights), check every replica's /health/ready once, subscribe
to each replica's KV events, then poll health every --health-check-interval. Like the API server, the router
imports no torch. On SIGTERM it drains as the server does (tokenmill/api/lifecycle.py): new requests get 503
(and /health turns 503, for a load balancer in front), in-flight ones finish, then it exits."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tokenmill.api.errors import ServiceUnavailable, error_response, exception_response, http_error_response
from tokenmill.api.lifecycle import CONTROL_PATHS, DrainingServer, Lifecycle
from tokenmill.heap import freeze_startup_heap
from tokenmill.router.kv_index import KVEventFeeds, KVIndex
from tokenmill.router.metrics import CONTENT_TYPE, RouterMetrics
from tokenmill.router.policy import make_policy
from tokenmill.router.prompt_tokens import PromptTokenizer
from tokenmill.router.proxy import (
    ADAPTER_PATHS,
    RouterState,
    fan_out_adapter,
    forward,
    forward_get,
    list_models,
)
from tokenmill.router.replicas import Replica, ReplicaClient, ReplicaSet
from tokenmill.router.router_config import RouterConfig
from tokenmill.router.sleep import IdleSleeper
from tokenmill.router.tenants import AdmissionQueue, TenantRegistry, load_tenants
from tokenmill.router.tracing import make_router_tracer

logger = logging.getLogger("tokenmill.router")


def build_state(config: RouterConfig, tokenizer) -> RouterState:
    client = ReplicaClient(config.request_timeout)
    urls = config.replica_urls
    replicas = [Replica(url, KVIndex(url, config.block_size), role=config.role_of(i)) for i, url in enumerate(urls)]
    tenants = TenantRegistry(load_tenants(config.tenants_config, urls)) if config.tenants_config else None

    def policy():
        return make_policy(config.policy, config.load_tokens_per_request, config.session_load_factor)
    replica_set, metrics = ReplicaSet(replicas, client, config.health_check_interval), RouterMetrics()
    sleeper = None
    if config.sleep_after_idle is not None:
        sleeper = IdleSleeper(replica_set, client, metrics, config.sleep_after_idle, config.sleep_level,
                              config.min_awake)
    return RouterState(config, replica_set, policy(), PromptTokenizer(tokenizer), metrics, client, tenants,
                       AdmissionQueue(config.max_concurrent_requests, config.max_queued_requests,
                                      config.queue_timeout),
                       make_router_tracer(config.otlp_traces_endpoint),
                       prefill_policy=policy() if config.disaggregated else None, sleeper=sleeper)


def join(state: RouterState, url: str, kv_events_endpoint: str | None, replay_endpoint: str | None) -> Replica:
    """A replica that joins the running router (a Ray Serve replica that started, tokenmill/router/ray_serve.py):
    its KV events are subscribed to; it is routed to once a health check passes (the caller may run one now)."""
    replica = Replica(url, KVIndex(url, state.config.block_size))
    state.replicas.replicas.append(replica)
    if kv_events_endpoint is not None:
        state.feeds.start(replica.index, kv_events_endpoint, replay_endpoint)
    return replica


def leave(state: RouterState, replica: Replica) -> None:
    """A replica that left (scaled down, or gone): no new requests go to it; those in flight finish there."""
    state.replicas.replicas.remove(replica)
    state.feeds.stop(replica.name)
    state.metrics.forget(replica.name)


def load_router_tokenizer(config: RouterConfig):
    """The replicas' tokenizer and chat template (no weights): the router's token ids are theirs."""
    from tokenmill.models.paths import resolve_model_path
    from tokenmill.chat_templates import load_chat_template
    from tokenmill.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(resolve_model_path(config.model), config.tokenizer)
    if config.chat_template is not None:
        tokenizer.chat_template = load_chat_template(config.chat_template)
    return tokenizer


# The data path: served by RouterGate itself, ahead of Starlette's routing and middleware, which were a
# measurable share of the router's CPU per request (every request of a burst waits for the ones before it)
# Every POST `tokenmill serve` answers (tokenmill/server/api_server.py), with how the router reads its prompt:
# chat and completions (and /invocations, either) are routed by their cached prefix; the rest by load and model.
FORWARDED_POSTS = {
    "/v1/chat/completions": "chat", "/v1/completions": "completions", "/invocations": "invocations",
    "/v1/responses": "responses",
    **dict.fromkeys(("/v1/chat/completions/batch", "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings",
                     "/pooling", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/tokenize",
                     "/detokenize"), "other")}
# GETs that any replica answers alike
FORWARDED_GETS = ("/version", "/tokenizer_info")
# A stored response is held by the replica that made it: each of these goes to the replicas in turn until one does
# not answer 404 (forward_get), with its method and query.
STORED_RESPONSE_ROUTES = {"/v1/responses/{response_id}": ["GET", "DELETE"],
                          "/v1/responses/{response_id}/cancel": ["POST"]}


class RouterGate:
    """Outermost ASGI app: while draining, work is refused with 503 (control paths still answer); in-flight
    requests are counted for the drain. POSTs to the OpenAI routes go straight to the proxy; everything else
    (health, metrics, models, unknown routes and wrong methods) to the Starlette app."""

    def __init__(self, app, lifecycle: Lifecycle, state: RouterState):
        self.app, self.lifecycle, self.state = app, lifecycle, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in CONTROL_PATHS:
            return await self.app(scope, receive, send)
        lc = self.lifecycle
        if lc.phase != "ready":
            self.state.metrics.rejections.labels("", "draining").inc()
            return await exception_response(ServiceUnavailable("the router is shutting down"))(scope, receive, send)
        lc.begin()
        try:
            route = FORWARDED_POSTS.get(scope["path"]) if scope["method"] == "POST" else None
            if route is None:
                return await self.app(scope, receive, send)
            try:
                response = await forward(self.state, Request(scope, receive), scope["path"], route)
            except Exception as e:  # noqa: BLE001 - a bug in the proxy: a 500 in the one error shape, logged
                logger.exception("proxying %s failed", scope["path"])
                response = exception_response(e)
            await response(scope, receive, send)
        finally:
            lc.end()


def build_app(state: RouterState, lifecycle: Lifecycle | None = None):
    config = state.config
    lifecycle = lifecycle or Lifecycle(config.shutdown_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        state.feeds = KVEventFeeds()
        for i, replica in enumerate(state.replicas.replicas):
            if config.kv_events_endpoint:
                replay = config.kv_events_replay_endpoint[i] if config.kv_events_replay_endpoint else None
                state.feeds.start(replica.index, config.kv_events_endpoint[i], replay)
        if state.sleeper is not None:
            await state.sleeper.find_asleep()
        await state.replicas.check_all()
        tasks = [asyncio.create_task(state.replicas.poll_forever())]
        if state.sleeper is not None:
            tasks.append(asyncio.create_task(state.sleeper.run_forever()))
        admitted = sum(r.healthy for r in state.replicas.replicas)
        logger.info("routing to %d replicas (%d admitted now) with --policy %s%s", len(state.replicas.replicas),
                    admitted, config.policy, ", disaggregated" if config.disaggregated else "")
        lifecycle.phase = "ready"
        freeze_startup_heap()
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await state.feeds.close()
            await state.client.aclose()
            if state.tracer is not None:
                state.tracer.shutdown()

    async def models(request: Request):
        return await list_models(state, request)

    async def get_any(request: Request):
        return await forward_get(state, request)

    async def stored_response(request: Request):
        return await forward_get(state, request, skip_not_found=True)

    async def adapter(request: Request):
        return await fan_out_adapter(state, request, request.url.path)

    async def health(request: Request):
        if lifecycle.phase != "ready":
            return error_response(503, "the router is shutting down", "service_unavailable_error")
        if not config.disaggregated and state.replicas.routable():
            return Response(status_code=200)
        if config.disaggregated and state.replicas.routable("prefill") and state.replicas.routable("decode"):
            return Response(status_code=200)
        what = "a prefill and a decode instance" if config.disaggregated else "replica"
        return error_response(503, f"no {what} is admitted", "service_unavailable_error")

    async def live(request: Request):
        return Response(status_code=200)

    async def metrics(request: Request):
        return Response(state.metrics.render(state.replicas.replicas, state.admission), media_type=CONTENT_TYPE)

    async def on_http_error(request: Request, exc: HTTPException):
        return http_error_response(exc)  # an unknown route or a wrong method, in the one error shape

    async def not_served_here(request: Request):
        raise AssertionError("RouterGate serves the POSTs of FORWARDED_POSTS")

    # Starlette, not FastAPI: a proxy validates nothing and documents no schema, and FastAPI's per-request layers
    # (dependency solving, its exit stacks and middleware) were a measurable share of the router's CPU per request.
    # FORWARDED_POSTS are listed so that another method on them answers 405, as in `tokenmill serve`.
    app = Starlette(lifespan=lifespan, exception_handlers={HTTPException: on_http_error}, routes=[
        *(Route(path, not_served_here, methods=["POST"]) for path in FORWARDED_POSTS),
        Route("/v1/models", models, methods=["GET"]),
        *(Route(path, get_any, methods=["GET"]) for path in FORWARDED_GETS),
        *(Route(path, stored_response, methods=methods) for path, methods in STORED_RESPONSE_ROUTES.items()),
        *(Route(path, adapter, methods=["POST"]) for path in ADAPTER_PATHS),
        Route("/health", health, methods=["GET"]),
        Route("/health/ready", health, methods=["GET"]),
        Route("/health/live", live, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"])])

    return RouterGate(app, lifecycle, state)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    RouterConfig.add_cli_args(parser)


def run_from_cli(args: argparse.Namespace) -> int:
    from tokenmill.logs import configure_logging
    try:
        config = RouterConfig.from_cli_args(args)
        if not config.replica_urls:
            raise ValueError("give at least one --backend URL (or --prefill and --decode URLs)")
        tokenizer = load_router_tokenizer(config)
        configure_logging()
        state = build_state(config, tokenizer)
    except (ValueError, OSError) as e:
        raise SystemExit(f"error: {e}") from None
    lifecycle = Lifecycle(config.shutdown_timeout)
    app = build_app(state, lifecycle)
    # proxy_headers off: nothing in the router reads the client's address, and uvicorn's middleware for it wraps
    # every request
    server = DrainingServer(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
                                           log_config=None, timeout_keep_alive=30, proxy_headers=False), lifecycle)
    server.run()
    return lifecycle.exit_code
