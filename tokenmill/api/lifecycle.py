"""The server's life: loading → ready → draining (SIGTERM) or dead (the engine process died), and what HTTP sees.

The port opens before the model loads, so that an orchestrator can tell "alive but loading" (/health/live 200,
/health 503) from "dead". /health means what it means in vLLM: 200 only when a request would be served, so that
scripts and probes written for vLLM (wait for /health, then send traffic) work; /health/ready is the same.
On SIGTERM the server stops admitting work (503) but keeps its port, lets
in-flight requests finish for up to --shutdown-timeout, fails what is left with a clear error, and exits 0.
If the engine process dies, pending requests fail with 503 at once and the server exits 1, so that it is
restarted."""
from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn

from tokenmill.api.errors import ServiceUnavailable, exception_response

logger = logging.getLogger("tokenmill.server")

# Paths that are about the server rather than work for it: always answered, never counted as in flight.
CONTROL_PATHS = ("/health", "/health/ready", "/health/live", "/ping", "/metrics", "/version", "/dashboard")


class Lifecycle:
    def __init__(self, shutdown_timeout_s: float):
        self.phase = "loading"  # loading | ready | draining | dead
        self.shutdown_timeout_s = shutdown_timeout_s
        self.exit_code = 0
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.server: uvicorn.Server | None = None
        self.engine_alive = lambda: True
        self.fail_pending = lambda reason: None  # set to the engine client's: ends every pending request

    def begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def end(self) -> None:
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    async def drain(self) -> None:
        """SIGTERM: wait for in-flight requests, then stop the server."""
        logger.info("SIGTERM: draining %d in-flight requests (up to %.0f s); new requests get 503",
                    self.in_flight, self.shutdown_timeout_s)
        try:
            await asyncio.wait_for(self._idle.wait(), self.shutdown_timeout_s)
        except TimeoutError:
            logger.warning("shutdown timeout: failing %d requests still in flight", self.in_flight)
            self.fail_pending("the server is shutting down")
            try:
                await asyncio.wait_for(self._idle.wait(), 5)
            except TimeoutError:
                pass
        logger.info("drained; exiting")
        self.stop()

    def engine_died(self, reason: str) -> None:
        """The pending requests have been failed already; give their error responses a moment, then exit 1."""
        if self.phase == "dead":
            return
        self.phase, self.exit_code = "dead", 1
        logger.error("the engine is dead (%s); the server exits with status 1", reason)
        asyncio.get_running_loop().call_later(1.0, self.stop)

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True


class DrainingServer(uvicorn.Server):
    """uvicorn stops listening on the first SIGTERM; we keep the port to answer 503 while draining."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle
        lifecycle.server = self

    def handle_exit(self, sig, frame) -> None:
        lc = self.lifecycle
        if sig != signal.SIGTERM or lc.phase in ("draining", "dead"):
            return super().handle_exit(sig, frame)
        if lc.phase == "loading":
            lc.phase = "draining"
            self.should_exit = True  # nothing accepted yet: just stop
            return
        lc.phase = "draining"
        # A signal handler runs between two bytecodes of the loop's thread: hand the drain to the loop itself.
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(lc.drain()))


class LifecycleApp:
    """Outermost ASGI app: health and readiness, 503 while loading or draining, and the in-flight count.
    `inner` is the OpenAI app, set once the engine is ready."""

    def __init__(self, lifecycle: Lifecycle):
        self.lifecycle = lifecycle
        self.inner = None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        lc, path = self.lifecycle, scope["path"]
        root = scope.get("root_path", "")  # --root-path: uvicorn puts it in front of the path, as Starlette strips
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        if path.startswith("/health") and path in CONTROL_PATHS and scope["method"] != "GET":
            return await _plain(send, 405, b"", [(b"allow", b"GET")])  # as FastAPI answers for its routes
        if path == "/ping" and scope["method"] not in ("GET", "POST"):
            return await _plain(send, 405, b"", [(b"allow", b"GET, POST")])
        if path == "/health/live":  # liveness: the process answers
            return await _plain(send, 200, b"")
        if path in ("/health", "/health/ready", "/ping"):  # readiness: a request now would be served (/ping:
            # SageMaker's health check, which vLLM answers as /health, on GET and POST)
            ok = lc.phase == "ready" and lc.engine_alive()
            why = b"" if ok else (lc.phase.encode() if lc.engine_alive() else b"engine dead")
            return await _plain(send, 200 if ok else 503, why)
        if self.inner is None or (lc.phase != "ready" and path not in CONTROL_PATHS):
            why = {"loading": "the model is still loading", "draining": "the server is shutting down"}.get(
                lc.phase, "the engine is not running")
            return await exception_response(ServiceUnavailable(why))(scope, receive, send)
        if path in CONTROL_PATHS:
            return await self.inner(scope, receive, send)
        lc.begin()
        try:
            await self.inner(scope, receive, send)
        finally:
            lc.end()


async def _plain(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})

