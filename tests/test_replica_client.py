"""The router's HTTP/1.1 client to its replicas (tokenmill/router/replica_client.py) against a scripted server: pooled
keep-alive connections, bodies whole and chunk by chunk, a pooled connection the server closed while idle, read
timeouts, refused connections and answers that are not HTTP. The router's tests (tests/test_router.py) run the
same client against real replicas."""
from __future__ import annotations

import asyncio

import pytest

from tokenmill.router.replica_client import TRANSPORT_ERRORS, ReplicaClient, ReplicaConnectionError


class ScriptedServer(asyncio.Protocol):
    """Answers by path. /json: a JSON body; /stream: two chunks, the second once `release_second` is set, then the
    last chunk once `release_end` is set; /close-after: a JSON body, then closes the connection (no Connection:
    close header, as a keep-alive timeout closes it); /silent: never answers; /garbage: not HTTP; /cut: half a
    body, then closes."""
    connections = 0
    requests: list[tuple[str, bytes]] = []
    release_second: asyncio.Event
    release_end: asyncio.Event

    def connection_made(self, transport):
        type(self).connections += 1
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes):
        self.buffer += data
        while b"\r\n\r\n" in self.buffer:
            head, rest = self.buffer.split(b"\r\n\r\n", 1)
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            if len(rest) < length:
                return
            self.buffer = rest[length:]
            path = head.split(b" ")[1].decode()
            type(self).requests.append((path, head + b"\r\n\r\n" + rest[:length]))
            asyncio.ensure_future(self.answer(path))

    async def answer(self, path: str) -> None:
        t, path = self.transport, path.split("?")[0]
        if path in ("/json", "/close-after"):
            t.write(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nx-a: 1\r\nx-a: 2\r\n'
                    b'content-length: 11\r\n\r\n{"ok":true}')
            if path == "/close-after":
                t.close()
        elif path == "/stream":
            t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"6\r\nfirst\n\r\n")
            await self.release_second.wait()
            t.write(b"7\r\nsecond\n\r\n")
            await self.release_end.wait()
            t.write(b"0\r\n\r\n")
        elif path == "/garbage":
            t.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        elif path == "/cut":
            t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly part")
            t.close()


@pytest.fixture
def scripted():
    async def start():
        ScriptedServer.connections, ScriptedServer.requests = 0, []
        ScriptedServer.release_second, ScriptedServer.release_end = asyncio.Event(), asyncio.Event()
        server = await asyncio.get_running_loop().create_server(ScriptedServer, "127.0.0.1", 0)
        return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    return start


def run(coro):
    return asyncio.run(coro)


async def post_and_read(client: ReplicaClient, url: str, path: str) -> bytes:
    """A POST whose answer is read whole; its connection goes back to the pool."""
    response = await client.post(url, path, b"{}", {})
    body = await response.read()
    response.release()
    return body


def test_a_pooled_connection_carries_one_request_after_another(scripted):
    async def scenario():
        server, url = await scripted()
        client = ReplicaClient(read_timeout_s=5)
        for i in range(3):
            response = await client.post(url, "/json", b'{"n":%d}' % i, {"content-type": "application/json",
                                                                          "x-trace": "t"})
            assert response.status == 200 and await response.read() == b'{"ok":true}'
            assert response.headers["content-type"] == "application/json" and response.headers["x-a"] == "1, 2"
            response.release()
        status, body, headers = await client.get(url + "/json?x=1", timeout_s=5)
        assert (status, body) == (200, b'{"ok":true}')
        await client.aclose()
        server.close()
        return ScriptedServer.connections, ScriptedServer.requests
    connections, requests = run(scenario())
    assert connections == 1
    assert [path for path, _ in requests] == ["/json"] * 3 + ["/json?x=1"]
    head, body = requests[2][1].split(b"\r\n\r\n", 1)
    assert head.startswith(b"POST /json HTTP/1.1\r\n") and body == b'{"n":2}'
    lines = head.lower().split(b"\r\n")
    assert b"content-length: 7" in lines and b"x-trace: t" in lines and b"content-type: application/json" in lines


def test_a_stream_arrives_chunk_by_chunk_and_its_connection_is_pooled_after_its_end(scripted):
    async def scenario():
        server, url = await scripted()
        client = ReplicaClient(read_timeout_s=5)
        response = await client.post(url, "/stream", b"{}", {})
        chunks = response.iter_chunks()
        assert await anext(chunks) == b"first\n"  # before the server sent the second
        ScriptedServer.release_second.set()
        assert await anext(chunks) == b"second\n"
        # the caller saw the answer's end in its content ([DONE]); the HTTP message's end comes after
        response.release(answer_over=True)
        ScriptedServer.release_end.set()
        await asyncio.sleep(0.05)
        assert await post_and_read(client, url, "/json") == b'{"ok":true}'
        await client.aclose()
        server.close()
        return ScriptedServer.connections
    assert run(scenario()) == 1


def test_the_read_timeout_counts_from_the_last_byte_not_from_the_request(scripted):
    """A stream whose chunks come 0.2 s apart runs past a 0.3 s read timeout; one that then stalls is cut."""
    async def scenario():
        server, url = await scripted()
        client = ReplicaClient(read_timeout_s=0.3)
        response = await client.post(url, "/stream", b"{}", {})
        chunks = response.iter_chunks()
        assert await anext(chunks) == b"first\n"
        for event in (ScriptedServer.release_second, ScriptedServer.release_end):
            await asyncio.sleep(0.2)
            event.set()
        assert [c async for c in chunks] == [b"second\n"]  # 0.4 s after the request, whole
        response.release()
        ScriptedServer.release_second, ScriptedServer.release_end = asyncio.Event(), asyncio.Event()
        stalled = await client.post(url, "/stream", b"{}", {})
        with pytest.raises(asyncio.TimeoutError):
            async for _ in stalled.iter_chunks():
                pass
        server.close()
    run(scenario())


def test_a_stream_left_before_its_end_closes_its_connection(scripted):
    """A client that went away: the replica must see the connection close (that is how it stops generating)."""
    async def scenario():
        server, url = await scripted()
        client = ReplicaClient(read_timeout_s=5)
        response = await client.post(url, "/stream", b"{}", {})
        assert await anext(response.iter_chunks()) == b"first\n"
        response.release()
        await asyncio.sleep(0.05)
        closed = response.connection.closed
        await post_and_read(client, url, "/json")
        server.close()
        return closed, ScriptedServer.connections
    assert run(scenario()) == (True, 2)


def test_a_connection_closed_while_pooled_is_replaced_once(scripted):
    async def scenario():
        server, url = await scripted()
        client = ReplicaClient(read_timeout_s=5)
        # pooled after the first: the client has not yet seen the server's close
        assert await post_and_read(client, url, "/close-after") == b'{"ok":true}'
        # written on the closed one, then sent anew
        assert await post_and_read(client, url, "/json") == b'{"ok":true}'
        server.close()
        return ScriptedServer.connections
    assert run(scenario()) == 2


@pytest.mark.parametrize("path, error", [("/silent", asyncio.TimeoutError), ("/garbage", ReplicaConnectionError),
                                         ("/cut", ReplicaConnectionError)])
def test_failures_are_transport_errors(scripted, path, error):
    async def scenario():
        server, url = await scripted()
        client = ReplicaClient(read_timeout_s=0.3)
        with pytest.raises(error) as raised:
            response = await client.post(url, path, b"{}", {})
            await response.read()
        server.close()
        return raised.value
    assert isinstance(run(scenario()), TRANSPORT_ERRORS)


def test_a_refused_connection_is_a_transport_error():
    async def scenario():
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # nothing listens on it once closed
        with pytest.raises(TRANSPORT_ERRORS):
            await ReplicaClient(read_timeout_s=1).post(f"http://127.0.0.1:{port}", "/json", b"{}", {})
    run(scenario())
