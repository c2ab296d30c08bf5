"""The engine process's RSS once a server is ready (issue 41, item 4: the default model in bf16 with a 256 MiB KV
pool, before and after the linear weights were kept once).

    .venv/bin/python benchmarks/engine_rss.py OUT.json NAME='serve flags' [NAME='serve flags' ...] [--rounds 3]
        [--root DIR]   (DIR: a checkout to run instead of this one, e.g. a worktree of an earlier commit)

Each configuration starts fresh `rounds` times, one at a time; the figure is the engine's RSS (the largest child
of the server) 3 s after /health answers and one short request ran (so that the first step's allocations are
in), median of the rounds, with the API server's RSS beside it."""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import httpx
import psutil

sys.path.insert(0, os.path.dirname(__file__))
from router_resilience import wait_http  # noqa: E402
from sleep_wake import completion, engine_rss_mib  # noqa: E402
from startup import provenance  # noqa: E402


def measure(flags: str, root: str, port: int) -> dict:
    env = {**os.environ, "PYTHONPATH": root, "TOKENMILL_NO_PROGRESS": "1"}
    cli = ["-c", "import sys; from tokenmill.cli import main; sys.argv[0] = 'tokenmill'; sys.exit(main())"]
    proc = subprocess.Popen([sys.executable, *cli, "serve", "--port", str(port), *shlex.split(flags)],
                            cwd=root, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health", proc, 600)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        completion(base, model)
        time.sleep(3)
        server = psutil.Process(proc.pid)
        return {"engine_rss_mib": round(engine_rss_mib(server), 1),
                "api_rss_mib": round(server.memory_info().rss / 2**20, 1)}
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("configs", nargs="+", help="NAME='serve flags'")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    parser.add_argument("--port", type=int, default=8350)
    args = parser.parse_args()
    results = {}
    for config in args.configs:
        name, _, flags = config.partition("=")
        rounds = [measure(flags, args.root, args.port) for _ in range(args.rounds)]
        results[name] = {"flags": flags, "rounds": rounds,
                         "engine_rss_mib": statistics.median(r["engine_rss_mib"] for r in rounds),
                         "api_rss_mib": statistics.median(r["api_rss_mib"] for r in rounds)}
        print(f"{name}: engine RSS {results[name]['engine_rss_mib']:.0f} MiB, API server "
              f"{results[name]['api_rss_mib']:.0f} MiB  ({flags})", flush=True)
    with open(args.out, "w") as f:
        json.dump({"provenance": provenance(), "root": args.root, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
