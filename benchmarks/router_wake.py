"""A request that reaches a sleeping replica behind `tokenmill router --sleep-after-idle`: its TTFT against the
replica's wake_up time plus its TTFT awake (issue 39's line: the first is about the sum of the other two).

One real `tokenmill serve --enable-sleep-mode` (the default model) behind one real `tokenmill router --min-awake 0`.
Each round: a streamed request while awake (the normal TTFT through the router), then idle until the router has
put the replica to sleep (`/is_sleeping`), then the same streamed request (TTFT through the wake). The wake's own
time is the router's `tokenmill_router:wake_seconds` histogram. Writes router_wake.json; prints the medians.

Usage: .venv/bin/python benchmarks/router_wake.py OUT_DIR [--rounds 5] [--idle 2]"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from startup import provenance

BODY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "stream": True}


def ttft(base: str, model: str) -> float:
    t0 = time.perf_counter()
    with httpx.stream("POST", f"{base}/v1/completions", json={**BODY, "model": model}, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def wake_seconds(router: str) -> tuple[float, float]:
    total = count = 0.0
    for family in text_string_to_metric_families(httpx.get(f"{router}/metrics", timeout=10).text):
        for s in family.samples:
            if s.name == "tokenmill_router:wake_seconds_sum":
                total = s.value
            elif s.name == "tokenmill_router:wake_seconds_count":
                count = s.value
    return total, count


def wait(predicate, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError("timed out")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--idle", type=float, default=2.0)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    bin_dir = os.path.dirname(sys.executable)
    replica, router = "http://127.0.0.1:8310", "http://127.0.0.1:8300"
    procs = []
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TOKENMILL_NO_PROGRESS": "1"}
    for name, cmd in (("server", [f"{bin_dir}/tokenmill", "serve", "--port", "8310", "--enable-sleep-mode"]),
                      ("router", [f"{bin_dir}/tokenmill", "router", "--port", "8300", "--policy", "least_load",
                                  "--backend", replica, "--sleep-after-idle", str(args.idle), "--min-awake", "0"])):
        log = open(os.path.join(args.out_dir, f"{name}.log"), "w")  # noqa: SIM115 - for the process's life
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env))
        wait(lambda u=(replica if name == "server" else router): httpx.get(f"{u}/health", timeout=2).status_code
             == 200, 300)
    try:
        model = httpx.get(f"{replica}/v1/models").json()["data"][0]["id"]
        rows = []
        for r in range(args.rounds):
            awake = ttft(router, model)
            wait(lambda: httpx.get(f"{replica}/is_sleeping", timeout=2).json()["is_sleeping"], 60)
            before = wake_seconds(router)
            asleep = ttft(router, model)
            after = wake_seconds(router)
            assert after[1] == before[1] + 1, "one wake per sleeping round"
            rows.append({"round": r, "ttft_awake_s": round(awake, 4), "ttft_asleep_s": round(asleep, 4),
                         "wake_s": round(after[0] - before[0], 4)})
            print(rows[-1], flush=True)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=60)
    summary = {k: round(statistics.median(row[k] for row in rows), 4)
               for k in ("ttft_awake_s", "ttft_asleep_s", "wake_s")}
    print(f"median of {args.rounds}: TTFT awake {summary['ttft_awake_s']:.3f} s, TTFT through a wake "
          f"{summary['ttft_asleep_s']:.3f} s, the wake {summary['wake_s']:.3f} s")
    with open(os.path.join(args.out_dir, "router_wake.json"), "w") as f:
        json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), **provenance(),
                   "rounds": args.rounds, "summary": summary, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
