"""Readiness while loading, backpressure and the KV-pool fit check on a server with small limits; request priority
over HTTP (--scheduling-policy priority) on a tiny random model; SIGTERM draining on a server of its own. Slow:
every test starts a real server."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from helpers import API_KEY, MODEL, SERVER_ARGS, RemoteServer, free_port, wait_until, wait_until_async

pytestmark = pytest.mark.slow

QUEUE_LIMIT = 8
NUM_BLOCKS = 200  # 3,200 tokens of KV cache, less than max_model_len


@pytest.fixture(scope="module")
def lone_server():
    # --max-num-seqs 2: the engine runs two requests at a time, so a burst queues whatever the machine's speed
    s = RemoteServer(["--api-key", API_KEY, "--max-num-queued-reqs", str(QUEUE_LIMIT), "--max-num-seqs", "2",
                      "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-model-len", "4096",
                      "--shutdown-timeout", "60"])
    yield s
    s.stop()


def test_health_only_once_ready(lone_server):
    # RemoteServer polled /health until 200; before that it saw /health 503 with /health/live 200 (loading)
    assert lone_server.seen_loading
    # and the first request once /health said 200 is served
    r = httpx.post(lone_server.url_for("/v1/completions"), headers=lone_server.headers(), timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert httpx.get(lone_server.url_for("/health/ready")).status_code == 200


def test_request_larger_than_the_kv_pool_is_refused(lone_server):
    r = httpx.post(lone_server.url_for("/v1/completions"), headers=lone_server.headers(), timeout=30,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 3500})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "KV cache" in error["message"] and str(NUM_BLOCKS * 16) in error["message"]
    assert error["param"] == "max_tokens"
    # and it blocked nothing: a normal request still runs
    ok = httpx.post(lone_server.url_for("/v1/completions"), headers=lone_server.headers(), timeout=60,
                    json={"model": MODEL, "prompt": "Hello", "max_tokens": 3})
    assert ok.status_code == 200


def test_burst_past_the_queue_limit_gets_503_with_retry_after(lone_server):
    # ~240-token prompts and two requests in the engine at a time: the burst piles up in the queue even when the
    # client (sharing 2 cores with the server) sends slowly. The exact limits are tested in-process.
    prompt = "Tell me a story about a cat. " * 30

    async def one(client):
        start = time.monotonic()
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                       "max_tokens": 8, "ignore_eos": True})
        return r, time.monotonic() - start

    async def main():
        # No connection limits: with max_connections=100 (and the default 20 keep-alive ones) httpx 0.28 let these
        # requests out a few at a time, so the burst never reached the server as one.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=lone_server.url, headers=lone_server.headers(), timeout=120,
                                     limits=limits) as client:
            return await asyncio.gather(*(one(client) for _ in range(100)))

    results = asyncio.run(main())
    codes = [r.status_code for r, _ in results]
    assert set(codes) == {200, 503}, codes
    for r, _ in results:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) > 0
            assert r.json()["error"]["type"] == "overloaded_error"
    assert max(elapsed for _, elapsed in results) < 120
    print(f"\nburst of 100 with --max-num-queued-reqs {QUEUE_LIMIT}: {codes.count(200)} x 200, "
          f"{codes.count(503)} x 503")


@pytest.fixture(scope="module")
def priority_server(tiny_llama_dir):
    """A tiny random Llama (milliseconds a step) under --scheduling-policy priority, one request at a time, so that
    every request past the first waits and the order they start in is the scheduler's."""
    s = RemoteServer(["--scheduling-policy", "priority", "--max-num-seqs", "1", "--max-model-len", "8192"],
                     model=tiny_llama_dir, server_args=SERVER_ARGS)
    s.model = tiny_llama_dir  # its served name
    yield s
    s.stop()


def test_priority_over_http_serves_lower_values_first(priority_server, lone_server):
    """With the engine busy (one running request), three requests of priority 10 then three of priority -10 queue;
    once the running one ends they start (first token) -10s first, each group in arrival order: vLLM's rule, a
    lower value is served earlier. Under the default policy (fcfs) a priority is refused with a 400."""
    model = priority_server.model
    started: list[str] = []

    async def stream(client, name: str, priority: int, max_tokens: int, first: asyncio.Event | None = None):
        async with client.stream("POST", "/v1/completions", json={
                "model": model, "prompt": f"Request {name}", "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True, "priority": priority}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {") and name not in started:
                    started.append(name)
                    if first is not None:
                        first.set()

    def waiting() -> float:
        return priority_server.metrics().get("vllm:num_requests_waiting", 0)

    async def main():
        async with httpx.AsyncClient(base_url=priority_server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=None)) as client:
            running = asyncio.Event()
            blocker = asyncio.create_task(stream(client, "blocker", 0, 8000, running))  # seconds of decoding
            await asyncio.wait_for(running.wait(), 60)
            queued = []
            for i, (name, priority) in enumerate([("low0", 10), ("low1", 10), ("low2", 10),
                                                  ("high0", -10), ("high1", -10), ("high2", -10)]):
                queued.append(asyncio.create_task(stream(client, name, priority, 2)))
                await wait_until_async(lambda: waiting() == i + 1, timeout_s=30, interval_s=0.02,
                                       message=f"{name} to wait in the engine's queue")
            assert not blocker.done(), "the running request ended before the queue was built"
            blocker.cancel()  # the client leaves: the engine aborts it, and the queue starts
            await asyncio.gather(blocker, return_exceptions=True)
            await asyncio.gather(*queued)

    asyncio.run(main())
    assert started == ["blocker", "high0", "high1", "high2", "low0", "low1", "low2"]

    r = httpx.post(lone_server.url_for("/v1/completions"), headers=lone_server.headers(), timeout=60,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "priority": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "priority" and "--scheduling-policy priority" in error["message"]


def test_sigterm_drains_in_flight_requests_then_exits_0(tiny_llama_dir):
    """50 streams in flight at SIGTERM: each one completes or ends with a clear error; later requests get 503;
    the exit status is 0. A server mechanism: the tiny random model, served under the default model's name, its
    streams long enough (150 tokens) that none has ended when the signal lands, as the test asserts."""
    lone_server = RemoteServer(["--api-key", API_KEY, "--shutdown-timeout", "60", "--served-model-name", MODEL,
                                "--max-model-len", "8192"], model=tiny_llama_dir)
    ended = []

    async def stream(client, first_tokens: asyncio.Queue):
        events, got_first = [], False
        async with client.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": "Write about the sea.", "max_tokens": 150, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if not got_first:
                        got_first = True
                        first_tokens.put_nowait(1)
        ended.append(1)
        return events

    async def main():
        first_tokens: asyncio.Queue = asyncio.Queue()
        async with httpx.AsyncClient(base_url=lone_server.url, headers=lone_server.headers(), timeout=120,
                                     limits=httpx.Limits(max_connections=60)) as client:
            streams = [asyncio.create_task(stream(client, first_tokens)) for _ in range(50)]
            # SIGTERM once the first streams are producing: the rest are queued or prefilling, all accepted
            for _ in range(5):
                await first_tokens.get()
            lone_server.proc.send_signal(signal.SIGTERM)
            ended_at_signal = len(ended)

            async def draining() -> bool:  # /health/ready turns 503 once the server has taken the signal
                return (await client.get("/health/ready")).status_code == 503

            await wait_until_async(draining, timeout_s=30, interval_s=0.05,
                                   message="the server to start draining after SIGTERM (/health/ready 503)")
            after = await client.post("/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
            ready = await client.get("/health/ready")
            return await asyncio.gather(*streams), after, ready, ended_at_signal

    all_events, after, ready, ended_at_signal = asyncio.run(main())
    assert ended_at_signal == 0
    assert after.status_code == 503 and after.json()["error"]["type"] == "service_unavailable_error"
    assert ready.status_code == 503
    completed = 0
    for events in all_events:
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        if "error" in last:
            assert last["error"]["message"]
        else:
            completed += 1
            assert any(c.get("finish_reason") == "length" for e in events[:-1]
                       for c in json.loads(e).get("choices", []))
    assert completed == 50  # the 60 s shutdown timeout is enough for all of them here
    try:
        code = lone_server.proc.wait(90)
        print(f"\nSIGTERM with 50 streams in flight: {completed}/50 completed, late request {after.status_code}, "
              f"exit status {code}")
        assert code == 0
    finally:
        lone_server.stop()


def test_reset_prefix_cache_forgets_every_prefix_and_says_so_on_the_event_stream(tiny_llama_dir, priority_server):
    """vLLM's POST /reset_prefix_cache (with VLLM_SERVER_DEV_MODE=1): 200, the same prompt then finds no cached
    prefix, and the KV event stream carries AllBlocksCleared. Without the dev mode the route is not there (404)."""
    import zmq

    from tokenmill.engine.kv_events import AllBlocksCleared, decode_batch
    assert httpx.post(priority_server.url_for("/reset_prefix_cache")).status_code == 404
    port = free_port()
    server = RemoteServer(["--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                             "endpoint": f"tcp://*:{port}"})],
                          env={"VLLM_SERVER_DEV_MODE": "1"}, model=tiny_llama_dir,
                          server_args=[*SERVER_ARGS[:2], "--max-model-len", "512", *SERVER_ARGS[4:]])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        def hits() -> float:
            return server.metrics().get("vllm:prefix_cache_hits_total", 0)

        def complete() -> None:
            r = httpx.post(server.url_for("/v1/completions"), timeout=60,
                           json={"model": tiny_llama_dir, "prompt": "A prompt of a few blocks. " * 12, "max_tokens": 2})
            assert r.status_code == 200, r.text
        def cleared() -> bool:
            while sub.poll(100):
                _, _, payload = sub.recv_multipart()
                if any(isinstance(e, AllBlocksCleared) for e in decode_batch(payload).events):
                    return True
            return False
        complete()
        complete()
        cleared()  # drained: what came before the reset (an engine also says AllBlocksCleared when it starts)
        cached = hits()
        assert cached >= 64  # the second request found the first's prefix
        r = httpx.post(server.url_for("/reset_prefix_cache"))
        assert r.status_code == 200 and r.content == b""
        complete()
        assert hits() == cached  # nothing found after the reset
        wait_until(cleared, 10, message="AllBlocksCleared on the KV event stream")
    finally:
        sub.close(0)
        ctx.term()
        server.stop()


def test_sigterm_to_the_process_group_with_nothing_in_flight_exits_0_without_an_error(tiny_llama_dir):
    """SIGTERM reaches the engine process as well as the API server when it goes to their process group (`docker
    stop`, systemd, a terminal), the engine first here: the engine ignores it and ends when the API server asks, so
    the server exits 0 and logs no ERROR (before, the API server saw its engine leave and exited 1)."""
    server = RemoteServer(["--max-model-len", "512"], model=tiny_llama_dir, server_args=SERVER_ARGS)
    try:
        engine = server.engine_process()
        engine.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # the engine, had it died of it, would have been noticed by now
        assert server.proc.poll() is None and engine.is_running()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        log = server.log_tail(10**6)
        print(f"\nSIGTERM to the engine, then to the API server: exit status {code}")
        assert code == 0, log
        assert "ERROR" not in log and "Traceback" not in log, log
        assert not engine.is_running()
    finally:
        server.stop()


def test_an_engine_killed_while_loading_is_named_in_the_error(tiny_llama_dir):
    """A start that fails says why: the engine process killed while it loads the model (here SIGKILL, as the OOM
    killer sends) ends the server with status 1 and an error naming the signal, not only an exit code."""
    import os
    import subprocess
    import sys

    import psutil
    exe = [sys.executable, "-m", "tokenmill.cli", "serve", MODEL, "--port", str(free_port()), *SERVER_ARGS]
    proc = subprocess.Popen(exe, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TOKENMILL_NO_PROGRESS": "1"})
    try:
        def engine():
            for child in psutil.Process(proc.pid).children(recursive=True):
                if "spawn_main" in " ".join(child.cmdline()):
                    return child
            return None
        child = wait_until(engine, 120, interval_s=0.05, message="the engine process to start",
                           retry_on=(psutil.Error,))
        child.kill()
        out, _ = proc.communicate(timeout=60)
        print(f"\n{[line for line in out.splitlines() if 'ERROR' in line]}")
        assert proc.returncode == 1
        assert "the engine process was killed by SIGKILL" in out and "while loading the model" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
