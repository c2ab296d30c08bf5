"""Soak: many streaming requests, a fifth of them abandoned mid-stream, and what the server is left holding.

Starts `tokenmill serve`, runs REQUESTS streaming completions at CONCURRENCY; each client aborts its stream at
a random point with probability ABORT_FRACTION (closing the connection, as a browser tab or a timed-out agent
does). Afterwards: errors among the requests that were not abandoned (must be 0), engine requests running and
KV usage (must return to 0), and the resident memory of both processes, after warm-up and at the end (growth
under 5% means nothing leaks per request).

Usage: .venv/bin/python benchmarks/soak.py [OUT_DIR] [--requests N] [--concurrency C] [server flags ...]"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import subprocess
import sys
import time

import httpx
import psutil

from tokenmill.ports import free_port

WORDS = "the a river stone light quiet engine paper north garden number over under seven silver".split()


def rss_mib(proc: psutil.Process) -> dict[str, float]:
    procs = {"api_server": proc}
    for child in proc.children(recursive=True):
        if "spawn_main" in " ".join(child.cmdline()):
            procs["engine"] = child
    return {name: round(p.memory_info().rss / 2**20, 1) for name, p in procs.items()}


def engine_state(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=30).text
    wanted = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "tokenmill:stalled_streams_aborted_total")
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(wanted)}


def wait_until_idle(base: str, timeout_s: float = 30) -> dict[str, float]:
    """Both RSS figures are taken with the engine idle (no request running, no KV held), after it has handed
    its freed heap back, so that they compare like with like."""
    deadline = time.monotonic() + timeout_s
    state = engine_state(base)
    while time.monotonic() < deadline and (state["vllm:num_requests_running"] or
                                           state["vllm:kv_cache_usage_perc"]):
        time.sleep(0.5)
        state = engine_state(base)
    time.sleep(1)
    return state


async def one(client: httpx.AsyncClient, rng: random.Random, stats: dict) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 64)))
    abort_after = rng.randint(1, 15) if rng.random() < stats["abort_fraction"] else None
    body = {"prompt": prompt, "max_tokens": 16, "ignore_eos": True, "stream": True, "temperature": 0.8}
    events = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                stats["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    stats["completed"] += 1
                    return
                if '"error"' in line:
                    stats["errors"].append(line[:200])
                    return
                events += 1
                if abort_after is not None and events >= abort_after:
                    stats["aborted"] += 1
                    return  # leaving the block closes the connection mid-stream
        if abort_after is None:
            stats["errors"].append("stream ended without [DONE]")
    except httpx.HTTPError as e:
        stats["errors"].append(f"{type(e).__name__}: {e}")


async def run(base: str, requests: int, concurrency: int, abort_fraction: float, on_progress) -> dict:
    stats = {"completed": 0, "aborted": 0, "errors": [], "abort_fraction": abort_fraction}
    rng = random.Random(0)
    todo = iter(range(requests))

    async def worker(client):
        for i in todo:
            await one(client, rng, stats)
            if (i + 1) % 500 == 0:
                on_progress(i + 1, stats)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return stats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", default="benchmarks/runs/soak")
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--abort-fraction", type=float, default=0.2)
    parser.add_argument("--warmup-requests", type=int, default=500, help="RSS baseline is taken after these")
    args, server_flags = parser.parse_known_args()
    os.makedirs(args.out, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    exe = os.path.join(os.path.dirname(sys.executable), "tokenmill")
    log = open(os.path.join(args.out, "server.log"), "w")
    server = subprocess.Popen([exe, "serve", "--port", str(port), "--disable-log-stats", *server_flags],
                              stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TOKENMILL_NO_PROGRESS": "1"})
    try:
        while not _healthy(base):
            if server.poll() is not None:
                raise SystemExit(f"tokenmill serve exited with {server.returncode}; see {log.name}")
            time.sleep(1)
        proc = psutil.Process(server.pid)
        started = time.monotonic()
        warm = asyncio.run(run(base, args.warmup_requests, args.concurrency, args.abort_fraction,
                               lambda *_: None))
        wait_until_idle(base)
        rss_warm = rss_mib(proc)
        print(f"after {args.warmup_requests} warm-up requests: RSS {rss_warm} MiB", flush=True)

        def progress(done, stats):
            print(f"  {done}/{args.requests}: {stats['completed']} completed, {stats['aborted']} abandoned, "
                  f"{len(stats['errors'])} errors, RSS {rss_mib(proc)} MiB", flush=True)
        stats = asyncio.run(run(base, args.requests, args.concurrency, args.abort_fraction, progress))
        wall = time.monotonic() - started
        state = wait_until_idle(base)
        rss_end = rss_mib(proc)
        growth = {k: round(100 * (rss_end[k] - rss_warm[k]) / rss_warm[k], 2) for k in rss_warm}
        result = {
            "requests": args.requests, "concurrency": args.concurrency, "abort_fraction": args.abort_fraction,
            "completed": stats["completed"], "abandoned": stats["aborted"], "errors": len(stats["errors"]),
            "error_samples": stats["errors"][:10], "warmup_errors": len(warm["errors"]),
            "after": state, "rss_mib_after_warmup": rss_warm, "rss_mib_end": rss_end, "rss_growth_pct": growth,
            "wall_s": round(wall, 1), "server_flags": server_flags,
            "cpu": _cpu(), "python": platform.python_version(),
        }
        with open(os.path.join(args.out, "soak.json"), "w") as f:
            json.dump(result, f, indent=2)
        print(json.dumps(result, indent=2))
        ok = (not stats["errors"] and not state["vllm:num_requests_running"]
              and not state["vllm:kv_cache_usage_perc"] and all(g < 5 for g in growth.values()))
        print("PASS" if ok else "FAIL")
        return 0 if ok else 1
    finally:
        server.terminate()
        server.wait(30)
        log.close()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _cpu() -> dict:
    info = {"cores": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                info["model"] = line.split(":", 1)[1].strip()
            if line.startswith("Flags:"):
                info["flags"] = " ".join(f for f in line.split() if f.startswith(("avx", "amx")))
    except OSError:
        pass
    return info


if __name__ == "__main__":
    sys.exit(main())
