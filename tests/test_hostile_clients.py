"""Clients that would hurt a server: huge bodies, huge prompts, and streams that are never read.

The server must refuse a body past --max-request-body-bytes (413) before reading it, refuse text that cannot fit
the context before tokenizing it, keep /health fast while big requests are being prepared (tokenizing runs off
the event loop), and abort a stream whose client stopped reading so that its KV blocks are freed."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import psutil
import pytest
from fake_engine import API_KEY, MODEL, InProcessServer
from helpers import RemoteServer, wait_until

from tokenmill.api.errors import StreamStalled
from tokenmill.config import EngineConfig
from tokenmill.engine.messages import EngineCoreOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.engine_client import EngineClient


# ---- in-process ----

@pytest.mark.anyio
async def test_body_over_the_limit_is_413_without_reading_it(tokenizer):
    app = InProcessServer(tokenizer, max_request_body_bytes=1000)
    async with app.http() as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 2000})  # Content-Length
        err = r.json()["error"]
        assert r.status_code == 413 and err["code"] == 413 and "--max-request-body-bytes 1000" in err["message"]

        async def chunked(size: int):
            yield b'{"model": "%s", "prompt": "' % MODEL.encode()
            for _ in range(size // 100):
                yield b"x" * 100
            yield b'", "max_tokens": 2}'
        r = await client.post("/v1/completions", content=chunked(2000), headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "is 2065 bytes" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", content=chunked(500), headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text  # a chunked body within the limit reaches the route whole


@pytest.mark.anyio
async def test_text_that_cannot_fit_is_refused_before_tokenizing(tokenizer):
    app = InProcessServer(tokenizer)  # max_model_len 2048
    huge = "hello " * 2_000_000  # 12 MB: ~17 s to tokenize on 2 cores
    async with app.http() as client:
        start = time.monotonic()
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": [
            {"role": "user", "content": huge}]})
        elapsed = time.monotonic() - start
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "messages" and "maximum context length is 2048" in err["message"]
        assert f"{len(huge)} characters" in err["message"]
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": ["hi", huge]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    print(f"\n12 MB chat message refused in {elapsed:.2f} s")


@pytest.mark.anyio
async def test_a_stream_left_unread_is_aborted():
    """The watchdog of the real EngineClient (no engine process): a stream with output waiting and no read for
    longer than the timeout is failed, its engine requests aborted, and the metric counts it."""
    client = EngineClient(EngineConfig())
    aborted = []
    client.abort = lambda ids, reason="abort": aborted.extend(ids)
    client.add_requests = lambda *args: None
    client.stream_stall_timeout_s = 0.2

    class Tok:
        eos_token_id = 0
        backend_tokenizer = None
    try:
        watchdog = asyncio.create_task(client._abort_stalled_streams())
        read, unread = (client.generate(name, [[1, 2]], SamplingParams(max_tokens=5), Tok()) for name in "ab")
        for stream in (read, unread):
            stream.__enter__()
            stream.queue.put_nowait(EngineCoreOutput(f"{stream.request_id}-0-0", [3]))
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not aborted:
            read.last_read = time.monotonic()  # this one's reader keeps coming back
            await asyncio.sleep(0.05)
        watchdog.cancel()
        assert aborted == ["b-0-0"] and isinstance(unread.error, StreamStalled) and read.error is None
        with pytest.raises(StreamStalled):
            await unread.__anext__()
    finally:
        client.shutdown()


# ---- against a real server ----

@pytest.fixture(scope="module")
def hostile_server(tiny_llama_dir):
    """The tiny random model under the default model's name: what is tested is the server, and its steps take
    milliseconds, so that fifty streams reach the point where their buffers fill within a second or two. Its
    context (8,192) outlasts any stream here: none ends before the stall timeout does it."""
    s = RemoteServer(["--api-key", API_KEY, "--stream-stall-timeout", "3", "--kv-cache-memory", "1GiB",
                      "--served-model-name", MODEL, "--max-model-len", "8192"], model=tiny_llama_dir)
    yield s
    s.stop()


def _api_rss(server: RemoteServer) -> int:
    return psutil.Process(server.proc.pid).memory_info().rss


@pytest.mark.slow
def test_big_bodies_are_refused_and_health_answers_under_them(hostile_server):
    s = hostile_server
    headers = {**s.headers(), "Content-Type": "application/json"}
    big = b"x" * (50 * 2**20)
    start = time.monotonic()
    r = httpx.post(s.url_for("/v1/completions"), content=big, headers=headers, timeout=30)
    took = time.monotonic() - start
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    eight_mb = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * (8 * 2**20 // 5)}]})

    async def main():
        async with httpx.AsyncClient(base_url=s.url, headers=headers, timeout=60) as client:
            async def big_request():
                return await client.post("/v1/chat/completions", content=eight_mb)

            async def probe():
                latencies = []
                while not all(t.done() for t in bigs):
                    t0 = time.monotonic()
                    assert (await client.get("/health")).status_code == 200
                    latencies.append(time.monotonic() - t0)
                    await asyncio.sleep(0.01)
                return latencies
            bigs = [asyncio.create_task(big_request()) for _ in range(10)]
            latencies = await probe()
            return [await t for t in bigs], latencies
    responses, latencies = asyncio.run(main())
    assert all(r.status_code == 400 and "characters" in r.json()["error"]["message"] for r in responses)
    # the latencies are figures, not asserts (benchmarks/big_requests.py measures them on a quiet machine)
    print(f"\n50 MB body: 413 in {took * 1000:.0f} ms; ten 8 MB chat requests: /health max "
          f"{max(latencies) * 1000:.1f} ms over {len(latencies)} probes")


@pytest.mark.slow
def test_fifty_streams_never_read(hostile_server):
    s = hostile_server
    idle_rss = _api_rss(s)
    # 20 logprobs: ~700 bytes an event, so that the server's buffers for the connection (64 KiB in the kernel,
    # 64 KiB in the transport) fill within ~200 tokens
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8000, "ignore_eos": True,
                       "stream": True, "logprobs": 20}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    sockets = []
    try:
        for _ in range(50):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read: the server must notice
            sock.connect(("127.0.0.1", s.port))
            sock.sendall(request)
            sockets.append(sock)
        peak_rss = idle_rss

        def all_aborted() -> bool:
            nonlocal peak_rss
            peak_rss = max(peak_rss, _api_rss(s))
            m = s.metrics()
            return (m["tokenmill:stalled_streams_aborted_total"] >= 50
                    and m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0)
        wanted = ("tokenmill:stalled_streams_aborted_total", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
        wait_until(all_aborted, timeout_s=300, interval_s=1,
                   message=lambda: f"all 50 aborted: { {k: v for k, v in s.metrics().items() if k in wanted} }")
    finally:
        for sock in sockets:
            sock.close()
    growth = (peak_rss - idle_rss) / 2**20
    print(f"\n50 unread streams: all aborted, KV usage 0; API server RSS idle {idle_rss / 2**20:.0f} MiB, "
          f"peak +{growth:.0f} MiB")
    assert growth < 200
    r = httpx.post(s.url_for("/v1/completions"), headers=s.headers(), timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200  # and the server serves on
