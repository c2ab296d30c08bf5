"""HTTP responses for the OpenAI routes: JSON bodies, server-sent events, and noticing a client that went away.

A client that disconnects must stop its work at once: its engine requests are aborted and their KV blocks
freed. For a non-streaming request until_disconnected() races the work against the disconnect; for a stream,
EventStreamResponse closes the event generator, whose cleanup aborts the engine requests."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from fastapi.responses import Response

DONE = b"data: [DONE]\n\n"


def json_response(obj, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


def sse_event(obj) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def sse_named_event(name: str, obj) -> bytes:
    """An event whose type has an `event:` line of its own, as the Responses and Messages APIs frame theirs."""
    return b"event: " + name.encode() + b"\n" + sse_event(obj)


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
    client goes away, even while no event is due. on_close: the engine stream's close(), for a client that went
    away before the generator started (closing a generator that never ran runs none of its cleanup)."""
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None,
                 on_close: Callable[[], None] | None = None):
        self.events = events
        self.on_close = on_close
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
            if self.on_close is not None:
                self.on_close()


class EventLog:
    """A stream's events kept as they come, for followers that may join late or come back (a background Responses
    stream): each follower reads from the event it asks for, then waits for the next ones until the log ends."""

    def __init__(self):
        self.events: list[bytes] = []  # one SSE event each; its index is its sequence number
        self.done = False
        self._changed = asyncio.Event()

    def extend(self, chunk: bytes) -> None:
        """A chunk of whole events (each ends with a blank line; their JSON has no raw newlines)."""
        self.events += [event + b"\n\n" for event in chunk.split(b"\n\n") if event]
        self._wake()

    def finish(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def follow(self, start: int) -> AsyncIterator[bytes]:
        """The events from index `start`, then each one as it comes, until the log ends."""
        i = start
        while True:
            changed = self._changed
            if i < len(self.events):
                yield b"".join(self.events[i:])
                i = len(self.events)
                continue
            if self.done:
                return
            await changed.wait()
