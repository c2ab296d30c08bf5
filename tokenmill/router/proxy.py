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

Everything a request holds (its admission slot, its replica's in-flight count, the upstream connection, its
span) is released once, when its response ends however it ends (Exchange.close)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.api.errors import error_response
from tokenmill.router.kv_index import KVEventFeeds, prompt_block_hashes
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import Policy, RouteRequest
from tokenmill.router.prompt_tokens import PromptTokenizer
from tokenmill.router.replica_client import TRANSPORT_ERRORS, ReplicaClient, ReplicaResponse
from tokenmill.router.replicas import Replica, ReplicaSet
from tokenmill.router.resume import ResumableStream, why_not_resumable
from tokenmill.router.router_config import RouterConfig
from tokenmill.router.tenants import AdmissionQueue, Rejected, Tenant, TenantRegistry, retry_after_header
from tokenmill.router.tracing import RouterTracer
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


def _route_request(state: RouterState, route: str, body: dict | None, session_header: str | None) -> RouteRequest:
    token_ids = state.tokenizer.token_ids(route, body) if body is not None and route != "other" else None
    if token_ids is None:
        return RouteRequest([], 0, session_header)
    hashes = prompt_block_hashes(token_ids, state.config.block_size)
    user = body.get("user")
    return RouteRequest(hashes, len(token_ids), session_header or (user if isinstance(user, str) else None))


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
    """POST `path` to the best replica for this request; `route` is chat, completions or other (no prompt)."""
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
    plan = state.policy.rank(routable, ex.route_request)
    if state.config.max_resumes > 0 and why_not_resumable(route, body) is None:
        ex.stream = ResumableStream(route, body, state.tokenizer.tokenizer)
        raw = ex.stream.upstream_body()
    last_failure = ""
    streaming = bool(body and body.get("stream"))
    for attempt, replica in enumerate(plan.ranked[:state.config.max_attempts]):
        if attempt == 0:
            state.metrics.overhead.observe(time.perf_counter() - arrived)
        reason = plan.reason if attempt == 0 else "retry"
        opened = await _open(state, ex, replica, path, raw, reason, whole=not streaming)
        if isinstance(opened, str):
            last_failure = opened
            continue
        upstream, first, chunks = opened
        ex.predicted, ex.committed = plan.predicted_cached_tokens.get(replica, 0), replica
        state.metrics.prompt_tokens.labels(replica.name).inc(ex.route_request.num_prompt_tokens)
        state.metrics.predicted_cached_tokens.labels(replica.name).inc(ex.predicted)
        response_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _SKIP_RESPONSE_HEADERS}
        response_headers.update({"x-tokenmill-replica": replica.url, "x-tokenmill-route-reason": reason,
                                 "x-tokenmill-predicted-cached-tokens": str(ex.predicted)})
        ex.status = upstream.status
        if chunks is None:  # a whole body (not streamed): one plain response; forward() closes the exchange
            if ex.status == 200 and len(first) <= MAX_USAGE_BODY:
                ex.usage = _usage(first)
            return Response(first, status_code=ex.status, headers=response_headers)
        if ex.stream is not None and upstream.status == 200:
            relay = _relay_resumable(state, ex, first, chunks)
        else:
            ex.stream = None  # an error answer passes through as it is
            relay = _relay(ex, first, chunks)
        return RelayResponse(ex, relay, upstream.status, response_headers)
    state.metrics.failures.labels("all_attempts_failed").inc()
    return _unavailable(f"no replica could serve the request ({last_failure})")


def _routable_for(state: RouterState, ex: Exchange) -> list[Replica]:
    """The admitted replicas this request may go to: its tenant's, if the tenant names any."""
    routable = state.replicas.routable()
    return ex.tenant.may_use(routable) if ex.tenant is not None else routable


async def _open(state: RouterState, ex: Exchange, replica: Replica, path: str, content: bytes, reason: str,
                whole: bool = False):
    """Sends the request to `replica` and waits for the first bytes of its body (all of it if `whole`: a
    response that is not streamed): (upstream, first, rest; rest None if whole) with the exchange now on that
    replica, or the failure's description (the replica was ejected or cooled down)."""
    state.metrics.requests.labels(replica.name, reason).inc()
    ex.tried.append(replica)
    replica.in_flight += 1
    try:
        upstream = await state.client.post(replica.url, path, content, ex.headers)
    except TRANSPORT_ERRORS as e:
        replica.in_flight -= 1
        state.replicas.eject(replica, f"{type(e).__name__} while proxying")
        state.metrics.retries.labels(replica.name, "connection").inc()
        return f"{replica.name}: {type(e).__name__}"
    ex.replica, ex.upstream, ex.reason = replica, upstream, reason
    if upstream.status in RETRY_STATUSES:
        if upstream.status == 503:
            state.replicas.cool_down(replica, upstream.headers.get("retry-after"))
        await ex.release_upstream()
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


async def _relay(ex: Exchange, first: bytes, chunks):
    """A stream that cannot be resumed (or an error answer to a streamed request), passed on as it comes."""
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    except TRANSPORT_ERRORS as e:
        logger.warning("%s failed mid-response: %s", ex.replica.name, type(e).__name__)
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
    route_request = RouteRequest(prompt_block_hashes(prompt, state.config.block_size), len(prompt),
                                 ex.route_request.session_key)
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


async def forward_get(state: RouterState, path: str) -> Response:
    """A GET that any replica answers alike (/v1/models): the first admitted replica that answers."""
    for replica in state.replicas.routable():
        try:
            status, body, upstream_headers = await state.client.get(replica.url + path)
        except TRANSPORT_ERRORS as e:
            state.replicas.eject(replica, f"{type(e).__name__} while proxying")
            continue
        headers = {k: v for k, v in upstream_headers.items() if k.lower() not in _SKIP_RESPONSE_HEADERS}
        return Response(body, status_code=status, headers=headers)
    return _unavailable("no replica is admitted")
