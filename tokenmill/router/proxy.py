"""One request's way through the router: admit (tenant limits, admission queue), tokenize, rank the replicas,
forward, retry elsewhere while nothing has reached the client, and resume elsewhere when a stream's replica
fails mid-way.

The router commits to a replica at the first byte of its response body, not at its status line: a replica can
send 200 and die before its first token (killed during prefill), and until a byte went out the request can
still go to the next replica in the policy's ranking, as if the first had never been tried. A response that is
not streamed is read whole before anything goes out (one plain response: no streaming machinery per request),
so it is retried elsewhere if its replica fails at any point. Connection errors
eject the replica (tokenmill/router/replicas.py); a 502/503/504 is retried elsewhere, a 503's Retry-After
becoming the replica's cooldown. Once bytes flow, a resumable stream (tokenmill/router/resume.py) is relayed
event by event and continued on another replica if its replica fails; anything else is passed through as it
comes, and a failure mid-way ends a stream with an error event.

Disaggregated serving (--prefill, --decode): a chat or completion request is first prefilled on a prefill
instance, then decoded on a decode instance, each chosen by the policy among its own pool (their KV indexes: the
prefill instance that caches most of the prompt computes least of it; the decode instance that caches most of it
fetches least). The shapes are vLLM's (its disaggregated proxy, tests/v1/kv_connector/nixl_integration/
toy_proxy_server.py): the prefill request is the client's with `kv_transfer_params` {"do_remote_decode": true,
...}, max_tokens 1, not streamed; its answer's top-level `kv_transfer_params` (opaque to the router) goes into
the client's own request, sent to the decode instance, whose answer is the client's. A prefill instance that
fails (connection, 5xx) is replaced by the next one in the ranking; the decode stage is then an ordinary request
on the decode pool: retried before its first byte, resumed mid-stream. A retried or resumed decode carries no
`kv_transfer_params` and recomputes the prompt on its instance: the blocks the first decode instance was to fetch
may be gone (fetched and freed, or timed out), and a resumed prompt holds the generated tokens too.

A replica asleep (--sleep-after-idle, tokenmill/router/sleep.py) is woken before a request is sent to it; the
request waits for the wake.

Everything a request holds (its admission slot, its replica's in-flight count, the upstream connection, its
span) is released once, when its response ends however it ends (Exchange.close)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.api.errors import HTTP_ERROR_TYPES, error_response
from tokenmill.router.kv_index import KVEventFeeds, prompt_block_hashes
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import Policy, RouteRequest
from tokenmill.router.prompt_tokens import PromptTokenizer
from tokenmill.router.replica_client import TRANSPORT_ERRORS, ReplicaClient, ReplicaResponse
from tokenmill.router.replicas import Replica, ReplicaSet
from tokenmill.router.resume import ResumableStream, why_not_resumable
from tokenmill.router.router_config import RouterConfig
from tokenmill.router.sleep import IdleSleeper, WakeFailed
from tokenmill.router.tenants import AdmissionQueue, Rejected, Tenant, TenantRegistry, retry_after_header
from tokenmill.router.tracing import RouterTracer
from tokenmill.sampling_params import cache_salt_keys
from tokenmill.tokenizer import INLINE_ENCODE_CHARS

logger = logging.getLogger("tokenmill.router.proxy")

RETRY_STATUSES = (502, 503, 504)  # the replica cannot serve now; another may
# hop-by-hop headers and those the proxy recomputes
_SKIP_REQUEST_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade"}
_SKIP_RESPONSE_HEADERS = {"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"}
RETRY_AFTER_S = "1"  # every replica failed or none is admitted: the next health check may admit one
MAX_USAGE_BODY = 8 << 20  # a non-streamed response larger than this is not parsed for its usage


@dataclass
class RouterState:
    config: RouterConfig
    replicas: ReplicaSet
    policy: Policy
    tokenizer: PromptTokenizer
    metrics: RouterMetrics
    client: ReplicaClient
    tenants: TenantRegistry | None = None
    admission: AdmissionQueue = field(default_factory=lambda: AdmissionQueue(0, 0, 1.0))
    tracer: RouterTracer | None = None
    feeds: KVEventFeeds | None = None  # the replicas' KV-event subscribers, while the app runs (its lifespan)
    prefill_policy: Policy | None = None  # disaggregated: ranks the prefill pool (state.policy the decode pool)
    sleeper: IdleSleeper | None = None  # --sleep-after-idle


def _route_request(state: RouterState, route: str, body: dict | None, session_header: str | None) -> RouteRequest:
    model = body.get("model") if body is not None else None
    model = model if isinstance(model, str) else None
    kind = prompt_kind(route, body)
    token_ids = state.tokenizer.token_ids(kind, body) if kind is not None else None
    user = body.get("user") if body is not None else None
    session_key = session_header or (user if isinstance(user, str) else None)
    salt = body.get("cache_salt") if body is not None else None
    return route_request_for(state, token_ids or [], model, session_key,
                             cache_salt_keys(salt if isinstance(salt, str) else None))


def prompt_kind(route: str, body: dict | None) -> str | None:
    """How the router reads the request's prompt (chat or completions), or None where it has none to route by.
    /invocations holds either, told apart by its fields as the server tells them (chat first)."""
    if body is None:
        return None
    if route == "invocations":
        return "chat" if "messages" in body else "completions" if "prompt" in body else None
    return route if route in ("chat", "completions") else None


def route_request_for(state: RouterState, token_ids: list[int], model: str | None,
                      session_key: str | None, salt_keys: tuple = ()) -> RouteRequest:
    """The request's route: its block keys as each replica keys them (a LoRA adapter's differ by replica; a
    cache_salt's keys enter them all), computed here, off the event loop for a long prompt."""
    request = RouteRequest(prompt_block_hashes(token_ids, state.config.block_size, salt_keys), len(token_ids),
                           session_key, model, token_ids, salt_keys=salt_keys)
    if token_ids and model is not None:
        for replica in state.replicas.replicas:
            request.block_hashes_on(replica)
    return request


@dataclass(eq=False)
class Exchange:
    """One client request from admission to the end of its response."""
    state: RouterState
    route_request: RouteRequest
    headers: dict[str, str]  # for the replicas
    tenant: Tenant | None
    span: object | None
    stream: ResumableStream | None = None
    replica: Replica | None = None  # the replica serving it now
    committed: Replica | None = None  # the replica whose first byte went out (the prediction was for it)
    prefilled_on: Replica | None = None  # disaggregated: the prefill instance whose KV the decode was sent
    upstream: ReplicaResponse | None = None
    reason: str = ""
    predicted: int = 0
    status: int = 0
    usage: dict | None = None
    tried: list[Replica] = field(default_factory=list)
    closed: bool = False

    async def release_upstream(self) -> None:
        if self.upstream is not None:
            upstream, self.upstream = self.upstream, None
            self.replica.in_flight -= 1
            self.replica.last_active = time.monotonic()
            # back to the pool if the body was read to its end (or a stream to its [DONE]), else the connection
            # closes, which is how the replica learns to stop generating
            upstream.release(answer_over=self.stream is not None and self.stream.done)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        state = self.state
        try:
            await self.release_upstream()
        finally:
            state.admission.release()
            state.metrics.request_finished()
            usage = self.stream.usage if self.stream is not None else self.usage
            cached = None
            if usage is not None and self.committed is not None and self.route_request.num_prompt_tokens:
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                state.metrics.actual_cached_tokens.labels(self.committed.name).inc(cached)
                outcome = "exact" if cached == self.predicted else ("over" if self.predicted > cached else "under")
                state.metrics.cache_predictions.labels(outcome).inc()
            if self.tenant is not None:
                self.tenant.release()
                if self.stream is not None:
                    self.tenant.charge(len(self.stream.generated))
                elif usage is not None:
                    self.tenant.charge(usage.get("completion_tokens", 0))
            if self.span is not None:
                state.tracer.end(self.span, {
                    "http.response.status_code": self.status, "tokenmill.router.replica": self.replica and
                    self.replica.url, "tokenmill.router.route_reason": self.reason,
                    "tokenmill.router.replicas_tried": len(self.tried),
                    "tokenmill.router.predicted_cached_tokens": self.predicted,
                    "tokenmill.router.cached_tokens": cached,
                    "tokenmill.router.resumes": self.stream.num_resumes if self.stream else 0,
                    "tokenmill.router.prefill_replica": self.prefilled_on and self.prefilled_on.url,
                    "tokenmill.router.tenant": self.tenant and self.tenant.name})


class RelayResponse:
    """A streamed answer relayed chunk by chunk (an ASGI app); its exchange is closed whatever happens, even if its
    body never starts. A client that goes away stops the relay at once: the replica's connection is closed, which
    is how the replica learns to stop generating. (Starlette's StreamingResponse does the same with an anyio task
    group per response, which cost a tenth of the router's CPU per streamed request; here it is one plain task.)"""

    def __init__(self, exchange: Exchange, chunks, status_code: int, headers: dict[str, str]):
        self.exchange, self.chunks, self.status_code = exchange, chunks, status_code
        self.raw_headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

    async def __call__(self, scope, receive, send):
        relay = asyncio.current_task()
        client_gone = asyncio.ensure_future(_disconnected(receive))

        def stop(_) -> None:
            relay.cancel()
        client_gone.add_done_callback(stop)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            client_gone.remove_done_callback(stop)  # the server reports the end of a response as a disconnect too
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not client_gone.done() or client_gone.cancelled():
                raise  # not the client's leaving: the server's own cancellation
            relay.uncancel()
        finally:
            client_gone.remove_done_callback(stop)
            client_gone.cancel()
            await self.exchange.close()


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def forward(state: RouterState, request: Request, path: str, route: str) -> Response:
    """POST `path` to the best replica for this request; `route` is chat, completions, invocations (either),
    responses or other (no prompt the router reads)."""
    arrived = time.perf_counter()
    tenant = None
    if state.tenants is not None:
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
        if tenant is None:
            state.metrics.rejections.labels("", "unauthorized").inc()
            state.metrics.request_finished()
            return error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                  "authentication_error")
    if tenant is not None and (refused := tenant.refusal_before_tokenizing()) is not None:
        return _tenant_refused(state, tenant, *refused)
    raw = await request.body()
    try:
        body = msgspec.json.decode(raw)
        body = body if isinstance(body, dict) else None
    except ValueError:  # msgspec.DecodeError included
        body = None  # forwarded as is: the replica answers 400
    session_header = request.headers.get("x-session-id")
    if len(raw) <= INLINE_ENCODE_CHARS:  # the body's bytes bound its prompt's characters
        route_request = _route_request(state, route, body, session_header)
    else:
        route_request = await asyncio.to_thread(_route_request, state, route, body, session_header)
    if tenant is not None and (refused := tenant.admit(route_request.num_prompt_tokens)) is not None:
        return _tenant_refused(state, tenant, *refused)
    try:
        await state.admission.acquire()
    except Rejected as e:
        if tenant is not None:
            tenant.release()
        state.metrics.rejections.labels(tenant.name if tenant else "", e.reason).inc()
        state.metrics.request_finished()
        response = error_response(503, str(e), e.reason)
        response.headers["Retry-After"] = RETRY_AFTER_S
        return response
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP_REQUEST_HEADERS
               and not (tenant is not None and k.lower() == "authorization")}
    if state.config.disaggregated and "x-request-id" not in headers:
        headers["x-request-id"] = str(uuid.uuid4())  # one id for the prefill and the decode, as vLLM's proxy sends
    span = state.tracer.start(route, request.headers) if state.tracer is not None else None
    if span is not None:
        state.tracer.inject(span, headers)
    exchange = Exchange(state, route_request, headers, tenant, span)
    try:
        response = await _dispatch(state, exchange, path, route, raw, body, arrived)
    except BaseException:
        await exchange.close()
        raise
    exchange.status = response.status_code
    if not isinstance(response, RelayResponse):
        await exchange.close()
    return response


def _tenant_refused(state: RouterState, tenant: Tenant, limit: str, wait: float) -> Response:
    """429 with Retry-After, counted by tenant and limit."""
    state.metrics.rejections.labels(tenant.name, limit).inc()
    state.metrics.request_finished()
    if limit == "max_parallel_requests":
        message = f"tenant {tenant.name!r} has {tenant.in_flight} requests in flight, its max_parallel_requests"
    else:
        what = "requests" if limit == "rpm" else "tokens"
        message = f"tenant {tenant.name!r} is over its {what}-per-minute limit; retry in {wait:.1f} s"
    response = error_response(429, message, "rate_limit_error")
    response.headers["Retry-After"] = retry_after_header(wait)
    return response


async def _dispatch(state: RouterState, ex: Exchange, path: str, route: str, raw: bytes, body: dict | None,
                    arrived: float) -> Response:
    routable = _routable_for(state, ex)
    if not routable:
        state.metrics.failures.labels("no_replica").inc()
        return _unavailable("no replica is admitted (all failed their health checks or are cooling down)"
                            + (f" among tenant {ex.tenant.name!r}'s replicas" if ex.tenant and ex.tenant.replicas
                               else ""))
    first_raw = None  # what the first attempt sends, if not what a retry sends (a decode with its KV)
    if state.config.disaggregated and prompt_kind(route, body) is not None:
        if "kv_transfer_params" in body:
            return error_response(400, "the router sets kv_transfer_params in disaggregated serving: leave it out",
                                  "invalid_request_error", "kv_transfer_params")
        prefilled = await _prefill(state, ex, path, body, arrived)
        if isinstance(prefilled, Response):
            return prefilled
        arrived = None  # the overhead was observed at the prefill
        if prefilled:
            first_raw = msgspec.json.encode({**body, "kv_transfer_params": prefilled})
    plan = state.policy.rank(routable, ex.route_request)
    if state.config.max_resumes > 0 and why_not_resumable(route, body) is None:
        ex.stream = ResumableStream(route, body, state.tokenizer.tokenizer)
        raw = ex.stream.upstream_body()
        if first_raw is not None:
            first_raw = ex.stream.upstream_body({"kv_transfer_params": prefilled})
    last_failure = ""
    streaming = bool(body and body.get("stream"))
    # a Responses request that continues a stored response goes where that response is stored: each replica
    # answers 404 for the ones it does not hold, and the next is asked
    find_previous = route == "responses" and body is not None and body.get("previous_response_id") is not None
    attempts = plan.ranked if find_previous else plan.ranked[:state.config.max_attempts]
    for attempt, replica in enumerate(attempts):
        if attempt == 0 and arrived is not None:
            state.metrics.overhead.observe(time.perf_counter() - arrived)
        reason = plan.reason if attempt == 0 else "retry"
        content = first_raw if attempt == 0 and first_raw is not None else raw
        opened = await _open(state, ex, replica, path, content, reason, whole=not streaming)
        if isinstance(opened, str):
            last_failure = opened
            continue
        upstream, first, chunks = opened
        if find_previous and upstream.status == 404 and attempt + 1 < len(attempts):
            await ex.release_upstream()
            continue
        ex.predicted, ex.committed = plan.predicted_cached_tokens.get(replica, 0), replica
        if ex.prefilled_on is not None:
            state.metrics.pd_requests.labels("decode", replica.name).inc()
        state.metrics.prompt_tokens.labels(replica.name).inc(ex.route_request.num_prompt_tokens)
        state.metrics.predicted_cached_tokens.labels(replica.name).inc(ex.predicted)
        response_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP_RESPONSE_HEADERS}
        response_headers.update({"x-tokenmill-replica": replica.url, "x-tokenmill-route-reason": reason,
                                 "x-tokenmill-predicted-cached-tokens": str(ex.predicted)})
        if ex.prefilled_on is not None:
            response_headers["x-tokenmill-prefill-replica"] = ex.prefilled_on.url
        ex.status = upstream.status
        if chunks is None:  # a whole body (not streamed): one plain response; forward() closes the exchange
            if ex.status == 200 and len(first) <= MAX_USAGE_BODY:
                ex.usage = _usage(first)
            return Response(first, status_code=ex.status, headers=response_headers)
        if ex.stream is not None and upstream.status == 200:
            relay = _relay_resumable(state, ex, first, chunks)
        else:
            ex.stream = None  # an error answer passes through as it is
            relay = _relay(ex.replica, first, chunks)
        return RelayResponse(ex, relay, upstream.status, response_headers)
    state.metrics.failures.labels("all_attempts_failed").inc()
    return _unavailable(f"no replica could serve the request ({last_failure})")


async def _prefill(state: RouterState, ex: Exchange, path: str, body: dict, arrived: float) -> dict | Response:
    """The prefill stage: the request prefilled on the best prefill instance that answers; returns the
    kv_transfer_params for the decode instance, or the response the client gets instead (a prefill instance's
    4xx, as it is; a 503 if none could prefill)."""
    prefill_body = {**body, "stream": False, "max_tokens": 1, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
        "remote_host": None, "remote_port": None}}
    if "max_completion_tokens" in prefill_body:
        prefill_body["max_completion_tokens"] = 1
    for name in ("stream_options", "min_tokens", "min_completion_tokens"):  # not for a 1-token prefill
        prefill_body.pop(name, None)
    content = msgspec.json.encode(prefill_body)
    routable = _routable_for(state, ex, "prefill")
    if not routable:
        state.metrics.failures.labels("no_prefill_replica").inc()
        return _unavailable("no prefill instance is admitted (all failed their health checks or are cooling down)")
    plan = state.prefill_policy.rank(routable, ex.route_request)
    last_failure = ""
    for attempt, replica in enumerate(plan.ranked[:state.config.max_attempts]):
        if attempt == 0:
            state.metrics.overhead.observe(time.perf_counter() - arrived)
        opened = await _open(state, ex, replica, path, content, plan.reason if attempt == 0 else "retry", whole=True)
        if isinstance(opened, str):
            last_failure = opened
            state.metrics.pd_prefill_failovers.labels(replica.name).inc()
            continue
        upstream, answer, _ = opened
        status, headers = upstream.status, upstream.headers
        await ex.release_upstream()
        if status >= 500:
            state.metrics.retries.labels(replica.name, str(status)).inc()
            state.metrics.pd_prefill_failovers.labels(replica.name).inc()
            last_failure = f"{replica.name} answered {status}"
            continue
        if status != 200:  # the request's own fault: every instance would say the same
            headers = {k: v for k, v in headers.items() if k.lower() not in _SKIP_RESPONSE_HEADERS}
            headers["x-tokenmill-prefill-replica"] = replica.url
            return Response(answer, status_code=status, headers=headers)
        ex.prefilled_on = replica
        state.metrics.pd_requests.labels("prefill", replica.name).inc()
        try:
            params = msgspec.json.decode(answer).get("kv_transfer_params")
        except (msgspec.DecodeError, AttributeError):
            params = None
        if not isinstance(params, dict):
            logger.warning("%s answered a prefill without kv_transfer_params (is it started with --kv-transfer-"
                           "config kv_role kv_producer?): the decode instance computes the prompt itself",
                           replica.name)
            return {}
        return params
    state.metrics.failures.labels("all_prefills_failed").inc()
    return _unavailable(f"no prefill instance could prefill the request ({last_failure})")


def _routable_for(state: RouterState, ex: Exchange, role: str | None = None) -> list[Replica]:
    """The admitted replicas this request may go to: its tenant's, if the tenant names any, and of those the ones
    that serve its model (a LoRA adapter loaded on some replicas only). If none lists the model, all are
    candidates: the replica's answer (404 for an unknown model) is the truthful one. Disaggregated, those of
    `role`: the decode instances unless the prefill ones are asked for (they serve every other route too)."""
    if state.config.disaggregated:
        role = role or "decode"
    routable = state.replicas.routable(role)
    if ex.tenant is not None:
        routable = ex.tenant.may_use(routable)
    model = ex.route_request.model
    if model is not None:
        serving = [r for r in routable if r.serves(model)]
        routable = serving or routable
    return routable


async def _open(state: RouterState, ex: Exchange, replica: Replica, path: str, content: bytes, reason: str,
                whole: bool = False, rechecked: bool = False):
    """Sends the request to `replica` and waits for the first bytes of its body (all of it if `whole`: a
    response that is not streamed): (upstream, first, rest; rest None if whole) with the exchange now on that
    replica, or the failure's description (the replica was ejected or cooled down). A replica asleep is woken
    first; one that answers 503 because it was put to sleep behind the router's back (with --sleep-after-idle) is
    woken and asked again, once (`rechecked`)."""
    state.metrics.requests.labels(replica.name, reason).inc()
    ex.tried.append(replica)
    replica.in_flight += 1
    replica.last_active = time.monotonic()
    if replica.asleep and state.sleeper is not None:
        try:
            await state.sleeper.wake(replica)
        except WakeFailed as e:
            replica.in_flight -= 1
            state.replicas.cool_down(replica, None)
            state.metrics.retries.labels(replica.name, "wake").inc()
            return str(e)
        except TRANSPORT_ERRORS as e:
            replica.in_flight -= 1
            state.replicas.eject(replica, f"{type(e).__name__} while waking it")
            state.metrics.retries.labels(replica.name, "wake").inc()
            return f"{replica.name}: {type(e).__name__} while waking it"
        except BaseException:  # cancelled while it waited (the wake goes on for the others)
            replica.in_flight -= 1
            raise
    try:
        upstream = await state.client.post(replica.url, path, content, ex.headers)
    except TRANSPORT_ERRORS as e:
        replica.in_flight -= 1
        state.replicas.eject(replica, f"{type(e).__name__} while proxying")
        state.metrics.retries.labels(replica.name, "connection").inc()
        return f"{replica.name}: {type(e).__name__}"
    ex.replica, ex.upstream, ex.reason = replica, upstream, reason
    if upstream.status in RETRY_STATUSES:
        await ex.release_upstream()
        if upstream.status == 503 and state.sleeper is not None and not rechecked \
                and await state.sleeper.found_asleep(replica):
            return await _open(state, ex, replica, path, content, reason, whole, rechecked=True)
        if upstream.status == 503:
            state.replicas.cool_down(replica, upstream.headers.get("retry-after"))
        state.metrics.retries.labels(replica.name, str(upstream.status)).inc()
        return f"{replica.name} answered {upstream.status}"
    try:
        if whole:
            first, chunks = await upstream.read(), None
        else:
            chunks = upstream.iter_chunks()
            first = await anext(chunks, b"")
    except TRANSPORT_ERRORS as e:
        await ex.release_upstream()
        state.replicas.eject(replica, f"{type(e).__name__} while proxying")
        state.metrics.retries.labels(replica.name, "connection").inc()
        return f"{replica.name}: {type(e).__name__}"
    return upstream, first, chunks


async def _relay(replica: Replica, first: bytes, chunks):
    """A stream that cannot be resumed (or an error answer to a streamed request), passed on as it comes."""
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    except TRANSPORT_ERRORS as e:
        logger.warning("%s failed mid-response: %s", replica.name, type(e).__name__)
        yield _stream_error(f"the replica serving this stream failed: {type(e).__name__}")


def _usage(body: bytes) -> dict | None:
    """A JSON response's usage object, if it has one."""
    try:
        usage = msgspec.json.decode(body).get("usage")
    except (msgspec.DecodeError, AttributeError):
        return None
    return usage if isinstance(usage, dict) else None


async def _relay_resumable(state: RouterState, ex: Exchange, first: bytes, chunks):
    """Relays a resumable stream event by event; when its replica fails before the stream's end, continues it on
    another replica (up to --max-resumes times)."""
    stream = ex.stream
    while True:
        try:
            out = stream.feed(first)
            if out:
                yield out
            if stream.failure is None and not stream.done:
                async for raw in chunks:
                    out = stream.feed(raw)
                    if out:
                        yield out
                    if stream.failure is not None or stream.done:
                        break
            if stream.done:
                return
            cause = stream.failure or "the stream ended before [DONE]"
            state.replicas.eject(ex.replica, f"failed mid-stream: {cause}")
        except TRANSPORT_ERRORS as e:
            cause = type(e).__name__
            state.replicas.eject(ex.replica, f"{cause} mid-stream")
        failed = ex.replica
        await ex.release_upstream()
        why_not = stream.can_resume()
        if why_not is None and stream.num_resumes >= state.config.max_resumes:
            why_not = f"resumed {stream.num_resumes} times already (--max-resumes)"
        if why_not is not None:
            logger.warning("%s failed mid-stream (%s); cannot resume: %s", failed.name, cause, why_not)
            state.metrics.failures.labels("mid_stream").inc()
            yield _stream_error(f"the replica serving this stream failed ({cause}) and it cannot be resumed: "
                                f"{why_not}")
            return
        logger.warning("%s failed mid-stream (%s) after %d tokens; resuming elsewhere", failed.name, cause,
                       len(stream.generated))
        out = stream.begin_resume()
        if out:
            yield out
        if stream.done:
            return
        opened = await _open_resumed(state, ex)
        if isinstance(opened, str):
            state.metrics.failures.labels("mid_stream").inc()
            yield _stream_error(f"the replica serving this stream failed ({cause}) and no replica could resume it "
                                f"({opened})")
            return
        first, chunks = opened


async def _open_resumed(state: RouterState, ex: Exchange):
    prompt, content = ex.stream.resume_request()
    candidates = [r for r in _routable_for(state, ex) if r not in ex.tried]
    if not candidates:
        return "no other replica is admitted"
    route_request = route_request_for(state, prompt, ex.route_request.model, ex.route_request.session_key,
                                      ex.route_request.salt_keys)
    last_failure = ""
    for replica in state.policy.rank(candidates, route_request).ranked[:state.config.max_attempts]:
        opened = await _open(state, ex, replica, "/v1/completions", content, "resume")
        if isinstance(opened, str):
            last_failure = opened
            continue
        upstream, first, chunks = opened
        if upstream.status != 200:
            await ex.release_upstream()
            last_failure = f"{replica.name} answered {upstream.status}"
            continue
        state.metrics.resumed_streams.labels(replica.name).inc()
        return first, chunks
    return last_failure


def _stream_error(message: str) -> bytes:
    error = {"error": {"message": message, "type": "service_unavailable_error", "param": None, "code": 503}}
    return b"data: " + json.dumps(error).encode() + b"\n\n"


def _unavailable(message: str) -> Response:
    response = error_response(503, message, "service_unavailable_error")
    response.headers["Retry-After"] = RETRY_AFTER_S
    return response


def _get_headers(state: RouterState, request: Request) -> dict[str, str]:
    """The client's headers for a GET to a replica (its API key included, unless the router's tenants own it)."""
    return {k: v for k, v in request.headers.items() if k.lower() not in _SKIP_REQUEST_HEADERS
            and not (state.tenants is not None and k.lower() == "authorization")}


async def forward_get(state: RouterState, request: Request, skip_not_found: bool = False):
    """A GET that any replica answers alike (/version, /tokenizer_info): the first admitted replica that answers.
    With skip_not_found (a stored response, held by one replica: its GET, DELETE, or POST .../cancel, none with a
    body), the first that does not answer 404. An answer that is an event stream (a background response followed
    with ?stream=true) is relayed as it comes."""
    answer, path, headers = None, request.url.path, _get_headers(state, request)
    if request.url.query:  # GET /v1/responses/{id}?stream=true&starting_after=N
        path += "?" + request.url.query
    for replica in state.replicas.routable():
        try:
            upstream = await state.client.request(request.method, replica.url, path, b"", headers)
        except TRANSPORT_ERRORS as e:
            state.replicas.eject(replica, f"{type(e).__name__} while proxying")
            continue
        headers_out = {k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP_RESPONSE_HEADERS}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return RelayResponse(HeldAnswer(upstream), _relay(replica, b"", upstream.iter_chunks()),
                                 upstream.status, headers_out)
        try:
            body = await upstream.read()
        except TRANSPORT_ERRORS as e:
            state.replicas.eject(replica, f"{type(e).__name__} while proxying")
            continue
        finally:
            upstream.release()
        answer = Response(body, status_code=upstream.status, headers=headers_out)
        if not (skip_not_found and upstream.status == 404):
            return answer
    return answer or _unavailable("no replica is admitted")


@dataclass
class HeldAnswer:
    """A relayed GET's replica answer, for RelayResponse to close: its connection goes back to the pool when the
    answer was read to its end, else it is closed."""
    upstream: ReplicaResponse

    async def close(self) -> None:
        self.upstream.release()


async def list_models(state: RouterState, request: Request) -> Response:
    """/v1/models: every model any admitted replica serves (a LoRA adapter may be loaded on some only), once; a
    replica's refusal (a 401: the client's key is wrong) is passed on if no replica lists any."""
    replicas, headers = state.replicas.routable(), _get_headers(state, request)
    answers = await asyncio.gather(*(state.client.get(r.url + "/v1/models", state.config.request_timeout, headers)
                                     for r in replicas), return_exceptions=True)
    cards: dict[str, dict] = {}
    refusal = None
    for replica, answer in zip(replicas, answers):
        if isinstance(answer, BaseException):
            if not isinstance(answer, TRANSPORT_ERRORS):
                raise answer
            state.replicas.eject(replica, f"{type(answer).__name__} while proxying")
            continue
        status, body, upstream_headers = answer
        if status == 200:
            for card in msgspec.json.decode(body).get("data", []):
                cards.setdefault(card["id"], card)
        else:
            refusal = Response(body, status_code=status, headers={
                k: v for k, v in upstream_headers.items() if k.lower() not in _SKIP_RESPONSE_HEADERS})
    if not cards:
        return refusal or _unavailable("no replica is admitted")
    return Response(msgspec.json.encode({"object": "list", "data": list(cards.values())}),
                    media_type="application/json")


ADAPTER_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


async def fan_out_adapter(state: RouterState, request: Request, path: str) -> Response:
    """vLLM's LoRA load and unload, on every replica (a tenant's own, if its key names some): 200 if every one
    took it, else the error shape (the replicas' status if they agree, else 502) naming which took it and which
    failed with what; `replicas` lists each one's answer either way. The replicas that took it are asked for their
    models at once, so the adapter's requests go only where it is loaded from the next request on."""
    tenant = None
    if state.tenants is not None:
        tenant = state.tenants.authenticate(request.headers.get("authorization"))
        if tenant is None:
            return error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                                  "authentication_error")
    raw = await request.body()
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        body = None
    name = body.get("lora_name") if isinstance(body, dict) else None
    if isinstance(body, dict) and path.endswith("unload_lora_adapter") and not name and body.get("lora_int_id"):
        return error_response(400, "through the router, unload an adapter by its lora_name: each replica numbers "
                                   "its adapters itself", "invalid_request_error", "lora_int_id")
    targets = state.replicas.replicas if tenant is None else tenant.may_use(state.replicas.replicas)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in _SKIP_REQUEST_HEADERS
               and not (tenant is not None and k.lower() == "authorization")}

    async def one(replica: Replica) -> tuple[int, str]:
        try:
            upstream = await state.client.post(replica.url, path, raw, headers)
        except TRANSPORT_ERRORS as e:
            return 502, f"{type(e).__name__} connecting to the replica"
        try:
            text = (await upstream.read()).decode(errors="replace")
        except TRANSPORT_ERRORS as e:
            return 502, f"{type(e).__name__} reading the replica's answer"
        finally:
            upstream.release(answer_over=True)
        if upstream.status != 200:
            try:
                text = msgspec.json.decode(text)["error"]["message"]
            except (msgspec.DecodeError, KeyError, TypeError):
                pass
        return upstream.status, text

    answers = await asyncio.gather(*(one(r) for r in targets))
    if isinstance(name, str):
        for replica, (status, _) in zip(targets, answers):
            if status == 200:
                replica.index.forget_adapter(name)  # unloaded, or loaded anew under a new id
    await asyncio.gather(*(state.replicas.read_models(r) for r in targets))
    replicas = [{"replica": r.url, "status": status, "message": text} for r, (status, text) in zip(targets, answers)]
    failed = [a for a in replicas if a["status"] != 200]
    if not failed and targets:
        return Response(msgspec.json.encode({"message": f"{len(targets)} of {len(targets)} replicas: "
                                             f"{answers[0][1]}", "replicas": replicas}), media_type="application/json")
    if not targets:
        return error_response(503, "no replica to load or unload the adapter on", "service_unavailable_error")
    took = [a["replica"] for a in replicas if a["status"] == 200]
    statuses = {a["status"] for a in failed}
    status = statuses.pop() if len(statuses) == 1 and not took else 502
    message = (f"{len(failed)} of {len(replicas)} replicas failed: "
               + "; ".join(f"{a['replica']} answered {a['status']}: {a['message']}" for a in failed)
               + (f"; it succeeded on {', '.join(took)}" if took else ""))
    type_ = HTTP_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "service_unavailable_error")
    error = msgspec.json.decode(error_response(status, message, type_).body)
    return Response(msgspec.json.encode({**error, "replicas": replicas}), status_code=status,
                    media_type="application/json")
