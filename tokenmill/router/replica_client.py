"""The router's HTTP/1.1 client to its replicas: keep-alive connections per replica, parsed with httptools.

Why not a client library: the router makes one upstream request per client request, and at c=64 on 2 cores its CPU
per request decides the latency it adds (a batch of responses that a replica finishes together queues in the
router). aiohttp's client was a third of that CPU (request and response objects, its connector, its payload
registry, its stream reader), httpx's more (it polls every pooled connection on every request). The replicas
are known servers speaking plain HTTP/1.1, so the client needs little: write the request's bytes on a pooled
connection, parse the answer with httptools as it arrives, hand the body on in the chunks it came in.

Failures are `ReplicaConnectionError` (refused, reset, closed early, a malformed answer) and `asyncio.TimeoutError`
(no connection within the connect timeout, or no byte from the replica for the read timeout): TRANSPORT_ERRORS.
A pooled connection that the replica closed while it sat idle (its keep-alive timeout) is replaced by a new one
once, if it failed before any byte of an answer: the replica never read that request."""
from __future__ import annotations

import asyncio
import collections
import ssl
from urllib.parse import urlsplit

import httptools

# refused, reset or broken connections, malformed answers, timeouts
TRANSPORT_ERRORS = (OSError, asyncio.TimeoutError)
PAUSE_READING_BYTES = 1 << 20  # a body buffered beyond this (a client reading slowly) pauses the replica's socket
DRAIN_S = 1.0  # how long a connection waits for the end of an answer its caller no longer reads
MAX_IDLE_PER_REPLICA = 256  # idle keep-alive connections kept per replica; more are closed after their answer


class ReplicaConnectionError(ConnectionError):
    """The connection to a replica failed, closed before the answer's end, or carried something that is not HTTP."""


class ReplicaResponse:
    """An answer being received: the status and headers once they arrived; the body as its chunks arrive.
    `release()` hands the connection back to the pool if the body was read to its end, else closes it."""

    def __init__(self, connection: Connection):
        self.connection = connection
        self.status = 0
        self.headers: dict[str, str] = {}  # lower-case names
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future | None = None

    async def read(self) -> bytes:
        """The whole body."""
        while not self._complete:
            await self._wait()
        body = b"".join(self._chunks)
        self._chunks.clear()
        return body

    async def iter_chunks(self):
        """The body's chunks as they arrive (httptools has undone any chunked transfer encoding)."""
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                self.connection.resume_reading_below(self._buffered)
                yield chunk
            if self._complete:
                return
            await self._wait()

    def release(self, answer_over: bool = False) -> None:
        """`answer_over`: the caller saw the answer's end in its content (a stream's [DONE]) before the HTTP
        message ended; the connection waits a moment for the end and then goes back to the pool."""
        if answer_over and not self._complete and self._error is None:
            self.connection.drain()
        else:
            self.connection.release(self._complete and not self._chunks)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self.connection.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None and not self._complete:
            raise self._error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _feed(self, chunk: bytes) -> None:
        self._chunks.append(chunk)
        self._buffered += len(chunk)
        self._wake()

    def _end(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        if not self._complete:
            self._error = error
            self._wake()


class Connection(asyncio.Protocol):
    """One keep-alive connection to a replica, carrying one request at a time."""

    def __init__(self, pool: ReplicaClient, key: tuple):
        self.pool, self.key = pool, key
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.response: ReplicaResponse | None = None
        self.headers_arrived: asyncio.Future | None = None
        self.received_any = False  # a byte of the current answer arrived
        self.keep_alive = False  # the answer ended and left the connection open (its end decides)
        self.closed = False
        self.paused = False
        self.draining = False  # the caller is done with the answer; its end is awaited, then the pool
        self.last_data = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self._headers: list[tuple[bytes, bytes]] = []

    def send(self, head: bytes, body: bytes) -> asyncio.Future:
        """Writes the request; the returned future gets the response once its headers are in."""
        self.response = ReplicaResponse(self)
        self.headers_arrived = self.loop.create_future()
        self.received_any = self.keep_alive = False
        self.last_data = self.loop.time()
        self.timer = self.loop.call_later(self.pool.read_timeout_s, self._check_timeout)
        self.transport.writelines((head, body))
        return self.headers_arrived

    def release(self, reusable: bool) -> None:
        self._stop_timer()
        self.response = None
        if reusable and self.keep_alive and not self.closed:
            self._resume_reading()  # the answer's end may have come in before a pause took hold
            self.pool._idle_connection(self)
        else:
            self.close()

    def drain(self) -> None:
        """The rest of the answer (the chunked encoding's last chunk) is read and dropped, then the connection is
        pooled; if it does not come within DRAIN_S, the connection is closed."""
        self.draining = True
        self._stop_timer()
        self._resume_reading()
        self.timer = self.loop.call_later(DRAIN_S, self.close)

    def close(self) -> None:
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    def resume_reading_below(self, buffered: int) -> None:
        if buffered < PAUSE_READING_BYTES // 2:
            self._resume_reading()

    # asyncio.Protocol
    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        if self.response is None:  # nothing is due on an idle connection
            self.close()
            return
        self.received_any = True
        self.last_data = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(ReplicaConnectionError(f"the replica's answer is not HTTP/1.1: {e}"))
            self.close()

    def connection_lost(self, exc):
        self.closed = True
        self._stop_timer()
        self.pool._forget(self)
        self._fail(ReplicaConnectionError(f"the replica closed the connection{f': {exc}' if exc else ''}"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes):
        self._headers.append((name, value))

    def on_headers_complete(self):
        headers: dict[str, str] = {}
        for name, value in self._headers:
            name, value = name.decode("latin-1").lower(), value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self._headers = []
        response = self.response
        response.status, response.headers = self.parser.get_status_code(), headers
        if not self.headers_arrived.done():
            self.headers_arrived.set_result(response)

    def on_body(self, body: bytes):
        if self.draining:
            return
        response = self.response
        response._feed(body)
        if response._buffered > PAUSE_READING_BYTES and not self.paused:
            self.paused = True  # the client reads slowly: let the replica's socket fill up instead of memory
            self.transport.pause_reading()

    def on_message_complete(self):
        self._stop_timer()
        self.keep_alive = self.parser.should_keep_alive()
        if self.draining:
            self.draining = False
            self.release(True)
        else:
            self.response._end()

    def _fail(self, error: BaseException) -> None:
        if self.headers_arrived is not None and not self.headers_arrived.done():
            self.headers_arrived.set_exception(error)
        if self.response is not None:
            self.response._fail(error)

    def _resume_reading(self) -> None:
        if self.paused:
            self.paused = False
            self.last_data = self.loop.time()  # the replica's silence while paused was the client's doing
            self.transport.resume_reading()

    def _check_timeout(self) -> None:
        """The read timeout: no byte from the replica for its length while an answer is due (not while paused:
        then the client is the slow one)."""
        timeout = self.pool.read_timeout_s
        idle = self.loop.time() - self.last_data
        if self.paused or idle < timeout:
            self.timer = self.loop.call_later(timeout - (0 if self.paused else idle), self._check_timeout)
            return
        self.timer = None
        self._fail(asyncio.TimeoutError(f"no answer from the replica for {timeout:g} s"))
        self.close()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class ReplicaClient:
    """The router's connection pool to its replicas. Bodies pass through as they are: nothing is decompressed,
    and nothing is added to a request but the Host and Content-Length headers."""

    def __init__(self, read_timeout_s: float, connect_timeout_s: float = 2.0):
        self.read_timeout_s, self.connect_timeout_s = read_timeout_s, connect_timeout_s
        self._idle: dict[tuple, list[Connection]] = {}
        self._targets: dict[str, tuple] = {}  # base URL -> (host, port, ssl, Host header)

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str]) -> ReplicaResponse:
        return await self.request("POST", base_url, path, body, headers)

    async def get(self, url: str, timeout_s: float | None = None,
                  headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
        """GET url, read whole: (status, body, headers). `timeout_s` bounds the whole exchange."""
        parts = urlsplit(url)
        base, path = f"{parts.scheme}://{parts.netloc}", parts.path or "/"
        if parts.query:
            path += "?" + parts.query

        async def exchange():
            response = await self.request("GET", base, path, b"", headers or {})
            try:
                return response.status, await response.read(), response.headers
            finally:
                response.release()
        return await asyncio.wait_for(exchange(), timeout_s) if timeout_s is not None else await exchange()

    async def request(self, method: str, base_url: str, path: str, body: bytes,
                      headers: dict[str, str]) -> ReplicaResponse:
        """Sends the request and waits for the answer's status and headers."""
        target = self._targets.get(base_url) or self._target(base_url)
        lines = [f"{method} {path} HTTP/1.1\r\nhost: {target[3]}\r\ncontent-length: {len(body)}\r\n"]
        lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
        lines.append("\r\n")
        head = "".join(lines).encode("latin-1")
        idle = self._idle.get(target)
        while idle:
            connection = idle.pop()
            if connection.closed:
                continue
            try:
                return await _exchange(connection, head, body)
            except ReplicaConnectionError:
                if connection.received_any:
                    raise
                break  # closed by the replica while idle, before it read this request: once more, anew
        return await _exchange(await self._connect(target), head, body)

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()

    def _target(self, base_url: str) -> tuple:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        target = (parts.hostname, port, https, parts.netloc)
        self._targets[base_url] = target
        return target

    async def _connect(self, target: tuple) -> Connection:
        host, port, https, _ = target
        _, connection = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
            lambda: Connection(self, target), host, port, ssl=ssl.create_default_context() if https else None),
            self.connect_timeout_s)
        return connection

    def _idle_connection(self, connection: Connection) -> None:
        idle = self._idle.setdefault(connection.key, [])
        if len(idle) >= MAX_IDLE_PER_REPLICA:
            connection.close()
        else:
            idle.append(connection)

    def _forget(self, connection: Connection) -> None:
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)


async def _exchange(connection: Connection, head: bytes, body: bytes) -> ReplicaResponse:
    """The request on `connection`, up to the answer's headers. A wait given up (a caller's timeout, a cancelled
    task) closes the connection: an answer may still come on it, for nobody."""
    try:
        return await connection.send(head, body)
    except BaseException:
        connection.close()
        raise
