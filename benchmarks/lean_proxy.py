"""A control for benchmarks/router_overhead.sh (VIA=lean): the least a routing proxy written in Python must do per
request, and nothing else, to learn whether Python can meet the overhead line at all.

Per request it does the router's routing work (decode the JSON body, tokenize the prompt with the served model's
tokenizer, compute its block keys with the engine's function, look them up in a KV index) and forwards the
request over a pooled keep-alive connection, relaying the response as it comes (whole or chunked). It has none
of the router's other work: no ASGI server or HTTP client library (httptools parses both sides, on uvloop), no
tenants, admission, metrics, spans, retries or stream resumption, one replica. Not a product: a measuring stick
between the bare TCP relay (VIA=relay) and the router.

Two client sides (the upstream side is the same): by default the request is forwarded from the connection's
data_received callback and the response written from the upstream connection's, with no task in between;
--asgi (VIA=lean-asgi) serves the same work as an ASGI app under uvicorn, as the router is served, where each
request runs in a task of its own and its response goes back through a queue to that task.

Usage: python benchmarks/lean_proxy.py LISTEN_PORT REPLICA_PORT [--asgi]"""
from __future__ import annotations

import argparse
import asyncio

import httptools
import msgspec
import uvicorn
import uvloop

from tokenmill.models.paths import resolve_model_path
from tokenmill.router.kv_index import KVIndex, prompt_block_hashes
from tokenmill.router.prompt_tokens import PromptTokenizer
from tokenmill.router.router_config import RouterConfig
from tokenmill.tokenizer import load_tokenizer

BLOCK_SIZE = RouterConfig.block_size  # the router's default


class Upstream(asyncio.Protocol):
    """One keep-alive connection to the replica; carries one request at a time, and hands its response to the
    client side (start, body, end) as it is parsed."""

    def __init__(self, pool: list[Upstream]):
        self.pool, self.parser, self.client = pool, httptools.HttpResponseParser(self), None
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport

    def send(self, client, head: bytes, body: bytes) -> None:
        self.client = client
        self.transport.write(head + body)

    def data_received(self, data: bytes):
        self.parser.feed_data(data)

    # httptools callbacks
    def on_message_begin(self):
        self.content_length, self.content_type = None, b"application/json"

    def on_header(self, name: bytes, value: bytes):
        name = name.lower()
        if name == b"content-length":
            self.content_length = int(value)
        elif name == b"content-type":
            self.content_type = value

    def on_headers_complete(self):
        self.client.start(self.parser.get_status_code(), self.content_type, self.content_length)

    def on_body(self, body: bytes):
        self.client.body(body)

    def on_message_complete(self):
        self.client.end()
        self.client = None
        self.pool.append(self)


class Downstream(asyncio.Protocol):
    """One client connection (keep-alive; one request at a time): the request is forwarded from data_received,
    and the response written as the upstream connection parses it, with no task between."""

    def __init__(self, proxy: LeanProxy):
        self.proxy, self.parser = proxy, httptools.HttpRequestParser(self)
        self.transport, self.parts, self.chunked = None, [], False

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        self.parser.feed_data(data)

    def on_url(self, url: bytes):
        self.url = url

    def on_message_begin(self):
        self.parts = []

    def on_body(self, body: bytes):
        self.parts.append(body)

    def on_message_complete(self):
        self.proxy.forward(self, self.parser.get_method(), self.url, b"".join(self.parts))

    # the upstream response
    def start(self, status: int, content_type: bytes, content_length: int | None):
        self.chunked = content_length is None
        framing = b"transfer-encoding: chunked" if self.chunked else b"content-length: %d" % content_length
        self.transport.write(b"HTTP/1.1 %d OK\r\ncontent-type: %s\r\n%s\r\n\r\n" % (status, content_type, framing))

    def body(self, body: bytes):
        self.transport.write(b"%x\r\n%s\r\n" % (len(body), body) if self.chunked else body)

    def end(self):
        if self.chunked:
            self.transport.write(b"0\r\n\r\n")


class AsgiExchange:
    """--asgi: the upstream response handed to an ASGI app's task through a queue (as any ASGI app must: the
    server calls the app in a task of its own, and the app answers through send)."""

    def __init__(self):
        self.events: asyncio.Queue = asyncio.Queue()

    def start(self, status: int, content_type: bytes, content_length: int | None):
        headers = [(b"content-type", content_type)]
        if content_length is not None:
            headers.append((b"content-length", b"%d" % content_length))
        self.events.put_nowait({"type": "http.response.start", "status": status, "headers": headers})

    def body(self, body: bytes):
        self.events.put_nowait({"type": "http.response.body", "body": body, "more_body": True})

    def end(self):
        self.events.put_nowait({"type": "http.response.body", "body": b"", "more_body": False})


class LeanProxy:
    def __init__(self, replica_port: int, tokenizer):
        self.replica_port, self.tokenizer = replica_port, PromptTokenizer(tokenizer)
        self.index = KVIndex("replica", BLOCK_SIZE)
        self.pool: list[Upstream] = []

    def forward(self, client, method: bytes, url: bytes, body: bytes) -> None:
        # the routing work, as the router does it: the prompt's tokens, its block keys, the index's prediction
        token_ids = self.tokenizer.token_ids("completions", msgspec.json.decode(body)) if body else None
        if token_ids is not None:
            self.index.predicted_cached_tokens(prompt_block_hashes(token_ids, BLOCK_SIZE))
        head = (b"%s %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                % (method, url, len(body)))
        if self.pool:
            self.pool.pop().send(client, head, body)
        else:
            asyncio.ensure_future(self._connect_and_send(client, head, body))

    async def _connect_and_send(self, client, head: bytes, body: bytes) -> None:
        _, upstream = await asyncio.get_running_loop().create_connection(
            lambda: Upstream(self.pool), "127.0.0.1", self.replica_port)
        upstream.send(client, head, body)

    async def asgi(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        exchange = AsgiExchange()
        self.forward(exchange, scope["method"].encode(), scope["path"].encode(), b"".join(parts))
        while True:
            event = await exchange.events.get()
            await send(event)
            if event["type"] == "http.response.body" and not event["more_body"]:
                return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("port", type=int)
    parser.add_argument("replica_port", type=int)
    parser.add_argument("--asgi", action="store_true", help="serve the client side with uvicorn (an ASGI app) "
                        "instead of httptools on the event loop; the upstream side stays the same")
    args = parser.parse_args()
    proxy = LeanProxy(args.replica_port, load_tokenizer(resolve_model_path("SmolLM2-135M-Instruct")))
    if args.asgi:
        # uvloop and httptools too, as for the router
        uvicorn.run(proxy.asgi, host="127.0.0.1", port=args.port, log_level="warning", interface="asgi3")
        return

    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(lambda: Downstream(proxy), "127.0.0.1", args.port)
        await server.serve_forever()

    uvloop.run(serve())


if __name__ == "__main__":
    main()
