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

from router_resilience import metric, wait_http
from sleep_wake import completion
from startup import provenance


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
    for url, name, cmd in ((replica, "server", [f"{bin_dir}/tokenmill", "serve", "--port", "8310",
                                                "--enable-sleep-mode"]),
                           (router, "router", [f"{bin_dir}/tokenmill", "router", "--port", "8300", "--policy",
                                               "least_load", "--backend", replica, "--sleep-after-idle",
                                               str(args.idle), "--min-awake", "0"])):
        log = open(os.path.join(args.out_dir, f"{name}.log"), "w")  # noqa: SIM115 - for the process's life
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env))
        wait_http(f"{url}/health", procs[-1], 300)
    try:
        model = httpx.get(f"{replica}/v1/models").json()["data"][0]["id"]
        rows = []
        for r in range(args.rounds):
            _, awake = completion(router, model)
            deadline = time.time() + 60  # the router puts the idle replica to sleep
            while not httpx.get(f"{replica}/is_sleeping", timeout=2).json()["is_sleeping"]:
                if time.time() > deadline:
                    raise SystemExit("the router did not put the replica to sleep")
                time.sleep(0.05)
            before = [metric(router, f"tokenmill_router:wake_seconds_{k}") for k in ("sum", "count")]
            _, asleep = completion(router, model)
            after = [metric(router, f"tokenmill_router:wake_seconds_{k}") for k in ("sum", "count")]
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
