"""Many clients at once, clients that go away, and an engine process that dies."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from helpers import API_KEY, MODEL, RemoteServer, wait_until, wait_until_async

# longer than a request can run in the 1.5 s a waiting client gives it, on the tiny model's millisecond steps
LONG = {"max_tokens": 6000, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    """The tiny random model under the default model's name: these tests load the server (many clients, clients
    that leave, an engine killed), not the model. Its steps take milliseconds, and the engine the last test kills
    is this module's, not the session's default server (which would load the real model again)."""
    s = RemoteServer(["--api-key", API_KEY, "--served-model-name", MODEL, "--max-model-len", "8192"],
                     model=tiny_llama_dir)
    yield s
    s.stop()


def _wait_until_idle(server, timeout_s: float = 60.0) -> dict[str, float]:
    last: dict[str, float] = {}

    def idle() -> dict[str, float] | None:
        last.update(server.metrics())
        if last["vllm:num_requests_running"] == 0 and last["vllm:num_requests_waiting"] == 0 \
                and last["vllm:kv_cache_usage_perc"] == 0:
            return dict(last)
        return None

    return wait_until(idle, timeout_s, interval_s=0.2, message=lambda: f"an idle engine; still busy: {last}")


def test_disconnects_abort_requests(server):
    _wait_until_idle(server)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120,
                                     limits=httpx.Limits(max_connections=100)) as client:
            async def stream_then_drop(i: int):
                path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Story {i}"}]})
                              if i % 2 else ("/v1/completions", {"prompt": f"Story number {i}:"}))
                async with client.stream("POST", path, json={"model": MODEL, "stream": True, **LONG, **body}) as r:
                    assert r.status_code == 200
                    chunks = 0
                    async for line in r.aiter_lines():
                        chunks += line.startswith("data: ")
                        if chunks >= 3:
                            return  # leaving the block closes the connection mid-stream

            async def wait_then_drop(i: int):
                with pytest.raises(httpx.ReadTimeout):
                    await client.post("/v1/completions", timeout=1.5,
                                      json={"model": MODEL, "prompt": f"Essay {i}:", **LONG})

            await asyncio.gather(*(stream_then_drop(i) for i in range(20)), *(wait_then_drop(i) for i in range(4)))

    asyncio.run(main())
    _wait_until_idle(server, timeout_s=30)


def test_256_concurrent_streams(server):
    num_clients, max_tokens = 256, 16

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "prompt": f"Request {i}: the quick brown fox", "max_tokens": max_tokens,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        text, usage, done = "", None, False
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["choices"]:
                    text += event["choices"][0]["text"]
                else:
                    usage = event["usage"]
        assert done and usage["completion_tokens"] == max_tokens
        return usage["completion_tokens"]

    async def main():
        limits = httpx.Limits(max_connections=num_clients + 16, max_keepalive_connections=num_clients + 16)
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=600,
                                     limits=limits) as client:
            start = time.perf_counter()
            results = await asyncio.gather(*(one(client, i) for i in range(num_clients)), return_exceptions=True)
            return time.perf_counter() - start, results

    wall, results = asyncio.run(main())
    errors = [r for r in results if isinstance(r, BaseException)]
    tokens = sum(r for r in results if isinstance(r, int))
    print(f"\n256-client streaming load: {len(results) - len(errors)}/{len(results)} ok, wall {wall:.1f} s, "
          f"{tokens} output tokens, {tokens / wall:.1f} output tok/s")
    assert not errors, errors[:3]
    _wait_until_idle(server)


def test_engine_death_fails_requests_with_503(server):
    """Last on purpose: it kills the module's server's engine.
    kill -9 on the engine: the stream in flight and the request waiting both get 503 within 5 s, and the server
    exits non-zero so that an orchestrator restarts it."""
    server.mark_broken()
    engine = server.engine_process()
    killed_at = []

    def both_in_the_engine() -> bool:
        m = server.metrics()
        return m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] >= 2

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=60) as client:
            streaming_started = asyncio.Event()

            async def streaming():
                events = []
                async with client.stream("POST", "/v1/completions", json={
                        "model": MODEL, "prompt": "Once", "stream": True, **LONG}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            if len(events) == 2:
                                streaming_started.set()
                return events, time.monotonic()

            async def waiting():
                await streaming_started.wait()
                r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "Twice", **LONG})
                return r, time.monotonic()

            async def kill_the_engine():
                # once the stream is producing and the second request is pending in the engine too
                await streaming_started.wait()
                await wait_until_async(lambda: asyncio.to_thread(both_in_the_engine), timeout_s=60, interval_s=0.05,
                                       message="the stream and the waiting request both in the engine")
                engine.send_signal(signal.SIGKILL)
                killed_at.append(time.monotonic())

            results = await asyncio.gather(streaming(), waiting(), kill_the_engine())
            return results[:2]

    (events, stream_end), (response, response_end) = asyncio.run(main())
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == 503 and "engine" in error["message"]
    assert response.status_code == 503 and "engine" in response.json()["error"]["message"]
    assert response.json()["error"]["type"] == "service_unavailable_error"
    assert stream_end - killed_at[0] < 5 and response_end - killed_at[0] < 5
    code = server.proc.wait(30)
    print(f"\nkill -9 on the engine: stream error after {stream_end - killed_at[0]:.2f} s, waiting request 503 "
          f"after {response_end - killed_at[0]:.2f} s, server exit status {code}")
    assert code != 0
