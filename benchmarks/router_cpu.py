"""The router's own cost, with no engine in the way: `tokenmill router` in front of an instant fake replica.

A replica of the real model makes the router's added latency hard to see: at c=64 its batches finish many
requests at once, and its step times drift more from run to run than the router adds. Here the replica answers at
once (a fixed chat completion, or a short SSE stream), so what the clients measure is the router's own work per
request and its queueing, and the router's CPU per request is read from /proc.

Three processes: the fake replica (httptools on uvloop), the router (`--policy kv`, the default model's tokenizer;
pinned with --router-cpu), and this one (the clients, on one event loop, keep-alive connections). The same
requests go direct to the fake replica and through the router, in alternating rounds, so that the machine's drift
falls on both alike.

Usage: .venv/bin/python benchmarks/router_cpu.py [OUT_DIR] [--requests N] [--rounds N] [--concurrency C] [--stream]
       [--chat] [--router-cpu K] [--client-cpu K] [--compare-tree DIR] [--profile]
  a before/after in one run:  git worktree add /tmp/before HEAD~1
                              .venv/bin/python benchmarks/router_cpu.py OUT --compare-tree /tmp/before"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

import httptools
import psutil
import uvloop
from router_resilience import wait_http  # this directory's: the benchmarks share their helpers

from tokenmill.ports import free_port

MODEL = "SmolLM2-135M-Instruct"
COMPLETION = json.dumps({
    "id": "chatcmpl-fake", "object": "chat.completion", "created": 0, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello."}, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41,
              "prompt_tokens_details": {"cached_tokens": 32}}}).encode()
STREAM_EVENTS = 16  # content events in a fake stream


def sse_stream() -> bytes:
    """A streamed chat completion: a role event, STREAM_EVENTS content events, the usage event, [DONE]."""
    events = [{"role": "assistant", "content": ""}] + [{"content": f" w{i}"} for i in range(STREAM_EVENTS)]
    out = [b"data: " + json.dumps({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                                   "model": MODEL, "choices": [{"index": 0, "delta": d, "finish_reason": None}]}
                                  ).encode() + b"\n\n" for d in events]
    out.append(b"data: " + json.dumps({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0,
                                       "model": MODEL, "choices": [], "usage": json.loads(COMPLETION)["usage"]}
                                      ).encode() + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


class FakeReplica(asyncio.Protocol):
    """Answers every POST at once; GET /health/ready 200 and /metrics with an idle engine's load."""

    def __init__(self):
        self.parser, self.transport, self.url, self.stream = httptools.HttpRequestParser(self), None, b"", False

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        self.parser.feed_data(data)

    def on_url(self, url: bytes):
        self.url = url

    def on_body(self, body: bytes):
        self.stream = self.stream or b'"stream":true' in body.replace(b" ", b"")

    def on_message_complete(self):
        if self.url.startswith(b"/metrics"):
            body, kind = b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n", b"text/plain"
        elif self.stream:
            body, kind = SSE_STREAM, b"text/event-stream"
        else:
            body, kind = (COMPLETION if self.parser.get_method() == b"POST" else b"{}"), b"application/json"
        self.stream = False
        if kind == b"text/event-stream":  # chunked, as a real stream is sent
            half = len(body) // 2
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked"
                                 b"\r\n\r\n%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (half, body[:half], len(body) - half,
                                                                             body[half:]))
        else:
            self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
                                 % (kind, len(body), body))


SSE_STREAM = sse_stream()


def serve_fake_replica(port: int) -> None:
    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(FakeReplica, "127.0.0.1", port)
        await server.serve_forever()
    uvloop.run(serve())


class Client(asyncio.Protocol):
    """One keep-alive client connection: one request at a time, the response read to its end."""

    def __init__(self):
        self.parser, self.transport, self.done = httptools.HttpResponseParser(self), None, None
        self.status = 0

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes):
        self.parser.feed_data(data)

    def on_message_complete(self):
        self.status = self.parser.get_status_code()
        self.done.set_result(None)

    async def request(self, head: bytes) -> int:
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(head)
        await self.done
        return self.status


def request_bytes(port: int, i: int, stream: bool, chat: bool) -> bytes:
    """A tiny completion, as benchmarks/router_overhead.sh sends; or a chat request with a system prompt."""
    if chat:
        path, body = b"/v1/chat/completions", {"messages": [
            {"role": "system", "content": "You are a terse assistant for a shipping company. " * 4},
            {"role": "user", "content": f"Question number {i % 50}: what is a harbour?"}]}
    else:
        path, body = b"/v1/completions", {"prompt": "Hello there, how"}
    body = json.dumps({"model": MODEL, "max_tokens": 1, "temperature": 0, "stream": stream, **body}).encode()
    return (b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (path, port, len(body), body))


async def run_round(port: int, requests: int, concurrency: int, stream: bool, chat: bool) -> list[float]:
    loop = asyncio.get_running_loop()
    clients = [(await loop.create_connection(Client, "127.0.0.1", port))[1] for _ in range(concurrency)]
    heads = [request_bytes(port, i, stream, chat) for i in range(requests)]
    latencies: list[float] = []
    todo = iter(heads)

    async def worker(client: Client) -> None:
        for head in todo:
            start = time.perf_counter()
            status = await client.request(head)
            latencies.append(time.perf_counter() - start)
            assert status == 200, status

    await asyncio.gather(*(worker(c) for c in clients))
    for c in clients:
        c.transport.close()
    return latencies


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def percentiles(latencies: list[float]) -> dict:
    q = statistics.quantiles(latencies, n=100)
    return {"p50_ms": round(1000 * q[49], 3), "p99_ms": round(1000 * q[98], 3),
            "mean_ms": round(1000 * statistics.fmean(latencies), 3)}


def git_commit(tree: str) -> str | None:
    done = subprocess.run(["git", "-C", tree, "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def start_router(port: int, replica_port: int, cpu: int, tree: str | None) -> subprocess.Popen:
    """`tokenmill router` from this checkout, or from another one (`tree`: its root) for a before/after in one run."""
    pin = ["taskset", "-c", str(cpu)] if cpu >= 0 else []
    if tree is None:
        program = [os.path.join(os.path.dirname(sys.executable), "tokenmill")]
    else:  # past the editable install's import hook, which maps `tokenmill` to this checkout
        program = [sys.executable, "-c", f"import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' "
                   f"not in str(f)]; sys.path.insert(0, {os.path.abspath(tree)!r}); from tokenmill.cli import main; "
                   f"sys.argv[0] = 'tokenmill'; sys.exit(main())"]
    return subprocess.Popen([*pin, *program, "router", "--port", str(port), "--policy", "kv", "--backend",
                             f"http://127.0.0.1:{replica_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default=None, help="where router_cpu.json and lscpu.txt go (optional)")
    parser.add_argument("--requests", type=int, default=4000, help="requests per round and path")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (each: direct, then via each router)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--stream", action="store_true", help="streamed requests (16 content events each)")
    parser.add_argument("--chat", action="store_true", help="chat requests with a 200-character system prompt "
                        "(the router renders the template and tokenizes it), instead of a tiny completion")
    parser.add_argument("--router-cpu", type=int, default=1, help="the CPU the router is pinned to (-1: none)")
    parser.add_argument("--client-cpu", type=int, default=0, help="the CPU the clients and the fake replica are "
                        "pinned to (-1: none)")
    parser.add_argument("--compare-tree", default=None, help="another checkout of tokenmill (e.g. a `git worktree` "
                        "of an older commit): its router is measured in the same rounds, the order swapped each round")
    parser.add_argument("--profile", action="store_true", help="record this checkout's router with py-spy during "
                        "the last round (OUT_DIR/router-profile.txt)")
    args = parser.parse_args()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    if args.client_cpu >= 0:
        os.sched_setaffinity(0, {args.client_cpu})
    replica_port = free_port()
    replica = subprocess.Popen([sys.executable, "-c", f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                                f"import router_cpu; router_cpu.serve_fake_replica({replica_port})"])
    routers = {"router": None} | ({"compare_router": args.compare_tree} if args.compare_tree else {})
    ports = {name: free_port() for name in routers}
    procs = {name: start_router(ports[name], replica_port, args.router_cpu, tree) for name, tree in routers.items()}
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or "py-spy"
    rounds = []
    try:
        wait_http(f"http://127.0.0.1:{replica_port}/health/ready", replica)
        for name, proc in procs.items():
            wait_http(f"http://127.0.0.1:{ports[name]}/health", proc)
            uvloop.run(run_round(ports[name], 500, args.concurrency, args.stream, args.chat))  # warm-up
        for r in range(args.rounds):
            direct = uvloop.run(run_round(replica_port, args.requests, args.concurrency, args.stream, args.chat))
            rounds.append({"direct": percentiles(direct)})
            d = rounds[-1]["direct"]
            line = f"round {r}: direct p50 {d['p50_ms']:.2f} p99 {d['p99_ms']:.2f}"
            order = list(procs.items()) if r % 2 == 0 else list(procs.items())[::-1]  # neither always first
            for name, proc in order:
                profile = None
                if args.profile and args.out and name == "router" and r == args.rounds - 1:
                    profile = subprocess.Popen([py_spy, "record", "--pid", str(proc.pid), "--format", "raw", "--rate",
                                                "1000", "-o", os.path.join(args.out, "router-profile.txt"),
                                                "--nonblocking"], stdout=subprocess.DEVNULL)
                    time.sleep(1.0)
                cpu, wall = cpu_seconds(proc.pid), time.perf_counter()
                via = uvloop.run(run_round(ports[name], args.requests, args.concurrency, args.stream, args.chat))
                cpu, wall = cpu_seconds(proc.pid) - cpu, time.perf_counter() - wall
                if profile is not None:
                    profile.send_signal(signal.SIGINT)
                    profile.wait(60)
                rounds[-1][name] = {**percentiles(via), "cpu_ms_per_request": round(1000 * cpu / args.requests, 4),
                                    "cpu_cores": round(cpu / wall, 3),
                                    "requests_per_s": round(args.requests / wall, 1)}
                v = rounds[-1][name]
                line += (f"; {name}: CPU {v['cpu_ms_per_request']:.3f} ms/request, {v['requests_per_s']:.0f} req/s, "
                         f"p50 {v['p50_ms']:.2f} p99 {v['p99_ms']:.2f} ms")
            print(line, flush=True)
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        replica.terminate()
        for proc in procs.values():
            proc.wait(30)
        replica.wait(10)
    result = {"concurrency": args.concurrency, "requests_per_round": args.requests, "stream": args.stream,
              "chat": args.chat, "router_cpu": args.router_cpu, "client_cpu": args.client_cpu,
              "commit": git_commit("."), "compare_tree": args.compare_tree,
              "compare_commit": git_commit(args.compare_tree) if args.compare_tree else None,
              **{f"{name}_cpu_ms_per_request_median": statistics.median(r[name]["cpu_ms_per_request"] for r in rounds)
                 for name in routers},
              "rounds": rounds}
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    if args.out:
        with open(os.path.join(args.out, "router_cpu.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "lscpu.txt"), "w") as f:
            f.write(subprocess.run(["lscpu"], capture_output=True, text=True).stdout)


if __name__ == "__main__":
    main()
