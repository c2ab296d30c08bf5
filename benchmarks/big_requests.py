"""Big bodies against a real server: how fast a 50 MB body is refused (413), and how /health answers while ten
8 MB chat requests are being received, parsed and checked.

Usage: .venv/bin/python benchmarks/big_requests.py [OUT_DIR] [server flags ...]"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from soak import _cpu, _healthy  # noqa: E402 - the soak benchmark's server helpers

from tokenmill.ports import free_port  # noqa: E402

ROUNDS = 5


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def round_of_big_requests(base: str, body: bytes) -> tuple[list[int], list[float]]:
    headers = {"Content-Type": "application/json"}
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        bigs = [asyncio.create_task(client.post("/v1/chat/completions", content=body, headers=headers))
                for _ in range(10)]
        latencies = []
        while not all(t.done() for t in bigs):
            start = time.perf_counter()
            r = await client.get("/health")
            latencies.append(time.perf_counter() - start)
            assert r.status_code == 200
            await asyncio.sleep(0.005)
        return [(await t).status_code for t in bigs], latencies


def main() -> int:
    out = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "benchmarks/runs/big-requests"
    flags = [a for a in sys.argv[1:] if a != out]
    os.makedirs(out, exist_ok=True)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    exe = os.path.join(os.path.dirname(sys.executable), "tokenmill")
    with open(os.path.join(out, "server.log"), "w") as log:
        server = subprocess.Popen([exe, "serve", "--port", str(port), "--disable-log-stats", *flags], stdout=log,
                                  stderr=subprocess.STDOUT, env={**os.environ, "TOKENMILL_NO_PROGRESS": "1"})
        try:
            while not _healthy(base):
                if server.poll() is not None:
                    raise SystemExit(f"tokenmill serve exited with {server.returncode}")
                time.sleep(1)
            refusals = []
            for _ in range(ROUNDS):
                start = time.perf_counter()
                r = httpx.post(base + "/v1/completions", content=b"x" * (50 * 2**20),
                               headers={"Content-Type": "application/json"}, timeout=60)
                refusals.append(time.perf_counter() - start)
                assert r.status_code == 413, r.text
            body = json.dumps({"messages": [{"role": "user", "content": "word " * (8 * 2**20 // 5)}]}).encode()
            latencies, statuses = [], []
            for _ in range(ROUNDS):
                codes, lat = asyncio.run(round_of_big_requests(base, body))
                statuses += codes
                latencies += lat
            result = {
                "body_50mb_413_ms": {"p50": round(percentile(refusals, 0.5) * 1e3, 1),
                                     "max": round(max(refusals) * 1e3, 1)},
                "ten_8mb_chat_requests": {"statuses": sorted(set(statuses)), "health_probes": len(latencies),
                                          "health_p50_ms": round(percentile(latencies, 0.5) * 1e3, 1),
                                          "health_p99_ms": round(percentile(latencies, 0.99) * 1e3, 1),
                                          "health_max_ms": round(max(latencies) * 1e3, 1)},
                "rounds": ROUNDS, "server_flags": flags, "cpu": _cpu(),
            }
        finally:
            server.terminate()
            server.wait(30)
    with open(os.path.join(out, "big_requests.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
